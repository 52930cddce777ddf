"""hutch guest boot helper, run once by /sbin/init as root (python3 -B -I).

1. Brings up the loopback interface: the image has no iproute2, and test
   suites bind 127.0.0.1 servers.
2. With HUTCH_PRELOAD=1, imports the standard-library modules that test suites
   and everyday scripts use, so their .pyc files, the extension modules and
   libpython are in the page cache when the host snapshots this VM: every VM
   restored from that snapshot then starts Python warm.

Python because it is already the cost we want to pay here (one interpreter
start warms the interpreter itself); nothing here writes to the filesystem.
"""
import fcntl
import os
import socket
import struct
import sys
import time

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

# Roughly what unittest/pytest-style suites, build scripts and data scripts import.
PRELOAD = """
abc argparse array ast asyncio atexit base64 binascii bisect bz2 calendar cmath codecs
collections collections.abc colorsys concurrent.futures configparser contextlib contextvars copy
cProfile csv ctypes dataclasses datetime decimal difflib dis doctest email email.message
email.mime.text email.parser email.policy enum errno faulthandler filecmp fileinput fnmatch
fractions ftplib functools gc getopt getpass gettext glob graphlib gzip hashlib heapq hmac html
html.parser http http.client http.cookies http.server imaplib importlib importlib.abc
importlib.machinery importlib.metadata importlib.resources importlib.util inspect io ipaddress
itertools json json.decoder keyword linecache locale logging logging.config logging.handlers
lzma mailbox math mimetypes multiprocessing multiprocessing.pool numbers operator optparse os
pathlib pdb pickle pkgutil platform plistlib posixpath pprint profile pstats pty queue quopri
random re reprlib runpy sched secrets select selectors shelve shlex shutil signal site smtplib
socket socketserver sqlite3 ssl stat statistics string stringprep struct subprocess symtable
sysconfig tabnanny tarfile tempfile termios textwrap threading time timeit token tokenize
tomllib trace traceback tracemalloc types typing typing_extensions unicodedata unittest
unittest.mock urllib urllib.error urllib.parse urllib.request uuid venv warnings wave weakref
xml xml.dom.minidom xml.etree.ElementTree xml.sax zipfile zipimport zlib zoneinfo
""".split()


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", ifreq)[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def preload() -> None:
    t0 = time.monotonic()
    missing = []
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # a module the image lacks (e.g. typing_extensions) is not an error
            missing.append(name)
    took = time.monotonic() - t0
    print(f"hutch-boot: imported {len(PRELOAD) - len(missing)} stdlib modules in {took:.2f} s"
          + (f"; not available: {' '.join(missing)}" if missing else ""), flush=True)


def main() -> int:
    status = 0
    try:
        loopback_up()
    except OSError as e:
        print(f"HUTCH_WARN cannot bring up loopback: {e}", flush=True)
        status = 1
    if os.environ.get("HUTCH_PRELOAD", "1") == "1":
        preload()
    return status


if __name__ == "__main__":
    sys.exit(main())
