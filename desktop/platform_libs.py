"""Before Qt starts on X11: whether the system libraries Qt's xcb plugin links are there, and, where one is
missing, the one install line that brings them. Qt itself would only print "Could not load the Qt platform
plugin "xcb"" and abort, which tells a person nothing they can act on."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

# The shared libraries Qt 6's xcb plugin needs beyond a desktop's usual X11 ones, and the Debian/Ubuntu
# packages that hold them (libxcb-cursor0 since Qt 6.5; the rest are often absent on a minimal desktop).
XCB_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libEGL.so.1": "libegl1",
    "libfontconfig.so.1": "libfontconfig1",
}
INSTALL = "sudo apt-get install -y " + " ".join(sorted(set(XCB_PACKAGES.values())))
MISSING = re.compile(r"([\w.+-]+\.so[.\d]*): cannot open shared object file")


def uses_xcb(env=os.environ, platform: str = sys.platform) -> bool:
    """Whether Qt will start on its xcb plugin: Linux, an X display, and no other platform asked for (a
    Wayland session's own plugin is tried first by Qt)."""
    asked = env.get("QT_QPA_PLATFORM", "")
    if not platform.startswith("linux") or (asked and not asked.startswith("xcb")):
        return False
    return bool(env.get("DISPLAY")) and not (env.get("WAYLAND_DISPLAY") and not asked)


def xcb_problem(qt_lib: Path | None = None) -> str | None:
    """What to tell a person when Qt's xcb support cannot load here (None: it loads, or the reason is not a
    missing system library). Loading Qt's own libQt6XcbQpa is what the plugin would do first."""
    if qt_lib is None:
        import PySide6

        qt_lib = Path(PySide6.__file__).parent / "Qt" / "lib" / "libQt6XcbQpa.so.6"
    if not qt_lib.is_file():
        return None
    try:
        ctypes.CDLL(str(qt_lib))
    except OSError as e:
        return advice(str(e))
    return None


def advice(error: str) -> str | None:
    """The message for a loader's error naming a missing library (None: another error)."""
    found = MISSING.search(error)
    if not found:
        return None
    lib = found.group(1)
    package = XCB_PACKAGES.get(lib)
    which = f"{lib} (package {package})" if package else lib
    return (
        f"kvchat cannot start its window: Qt's X11 support needs {which}, which is not installed.\n"
        f"On Debian or Ubuntu, one line installs it and the others Qt's X11 plugin needs:\n  {INSTALL}\n"
        "(Elsewhere: your distribution's package of that library.)"
    )
