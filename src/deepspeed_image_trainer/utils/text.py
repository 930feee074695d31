"""Short text for one-line messages: lists cut to a few items, the first line of an error."""
SHOWN = 5  # files named in a one-line warning


def error_line(err):
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def listed(items, shown=SHOWN):
    items = list(items)
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(map(str, items[:shown])) + more


def drawable(text):
    """`text` as a figure can draw it: a name that is not UTF-8 (its bytes kept as surrogates, which matplotlib
    refuses) with those bytes written as escapes, \\udcff, as Python's stderr writes them."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def digits(number):
    """How many decimal digits a whole number has, without writing it out (str() refuses beyond 4300)."""
    return len(str(abs(number))) if abs(number) < 10**4000 else int(abs(number).bit_length() * 0.30103) + 1
