"""A tool's Ctrl-C while it imports torch (seconds): one line and status 130, as run_cli gives once it runs, not a
KeyboardInterrupt traceback (or, inside torch's C++ initialisation, an abort). Nothing heavy is imported here."""
import contextlib
import os
import signal


@contextlib.contextmanager
def quiet_interrupt_while_importing(enabled=True):
    """Within the block, SIGINT ends the process at once with one line; `enabled`: only for a script's own run
    (`__name__ == "__main__"`), not for a program that imports the tool."""
    if not enabled:
        yield
        return

    def stopped(signum, frame):
        os.write(2, b"error: stopped by Ctrl-C (SIGINT) while starting; nothing was written\n")
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGINT, stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
