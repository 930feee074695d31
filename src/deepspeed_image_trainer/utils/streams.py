"""Output that outlives its reader: `launch_deepspeed.py ... | head` (or a console output redirected to a full
disk) must not end a training run or a tool in a traceback, and neither must printing a file
name that is not UTF-8."""
import io
import os
import sys


class OutlivesReader:
    """A text stream whose writes go to /dev/null once one fails (the pipe lost its reader: BrokenPipeError; a
    full disk), for the rest of the process and the processes it starts after, instead of raising in whoever
    printed."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError:
            self._reader_gone()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError:
            self._reader_gone()

    def _reader_gone(self):
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError):  # a stream of no file (a test's capture): this one's writes go nowhere
            self._stream = open(os.devnull, "w")
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)  # what is still buffered goes there too
        os.close(devnull)

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def outlive_closed_output():
    """Wrap sys.stdout and sys.stderr (before anything keeps a reference to them, as logging handlers do).

    A standard descriptor closed at the start (`>&-`, `<&-`) is opened on /dev/null first: Python leaves
    sys.stdout None then (flushing it at the exit raised), and the processes started after would have none."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            # A file name that is not UTF-8 (its bytes kept as surrogates) printed in a warning or the data
            # check's report raised UnicodeEncodeError; written as Python writes it to stderr, \udcff, instead
            stream.reconfigure(errors="backslashreplace")
        if stream is not None and not isinstance(stream, OutlivesReader):
            setattr(sys, name, OutlivesReader(stream))
