"""tools/layering/check.py on small trees made here, one fault planted in each.

Each tree is a core (src/) of two floors, a public header (include/) and an
extension (python/usmipc/_ext/), compiled with `cc -c` into folders laid out
as CMake lays out its objects; the check must pass on the clean tree and fail,
naming the offending pair, on each planted fault. No GPU, no build of the
project: a few milliseconds of compiling per tree.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "tools", "layering", "check.py")
CC = shutil.which("cc")
NM = shutil.which(os.environ.get("NM", "nm"))

pytestmark = pytest.mark.skipif(CC is None or NM is None,
                                reason="needs cc and nm (binutils)")

TABLE = """\
[core] src/
1 low:  src/low.c src/low.h
2 high: src/high.c src/high.h
[extension] python/usmipc/_ext/
1 all:  python/usmipc/_ext/ext.c
"""

CLEAN = {
    "include/usmipc.h": """\
        #ifndef USMIPC_H
        #define USMIPC_H
        int usmipc_pub(void);
        #endif
        """,
    "src/low.h": """\
        #ifndef LOW_H
        #define LOW_H
        int usmipc__low(void);
        #endif
        """,
    "src/low.c": """\
        #include "low.h"
        int usmipc__low(void) { return 1; }
        """,
    "src/high.h": """\
        #ifndef HIGH_H
        #define HIGH_H
        #include "low.h"
        int usmipc__high(void);
        #endif
        """,
    "src/high.c": """\
        #include "high.h"
        #include "usmipc.h"
        int usmipc__high(void) { return usmipc__low() + 1; }
        int usmipc_pub(void) { return usmipc__high(); }
        """,
    "python/usmipc/_ext/ext.c": """\
        #include "usmipc.h"
        int ext_entry(void) { return usmipc_pub(); }
        """,
}

EXT_DIR = "python/usmipc/_ext/"


def run_check(tmp_path, files=None, table=TABLE, extra_objects=()):
    """Writes the tree, compiles every .c file where CMake would put its
    object, runs the check; returns (exit status, output)."""
    tree = tmp_path / "tree"
    for name, text in (files if files is not None else CLEAN).items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tree / "floors.txt").write_text(table)
    core_objects = tmp_path / "build" / "CMakeFiles" / "usmipc_objects.dir"
    ext_objects = tmp_path / "build-layering" / "python" / "CMakeFiles" / \
        "_usmipc.dir"
    for name in (files if files is not None else CLEAN):
        if not name.endswith(".c"):
            continue
        if name.startswith(EXT_DIR):
            obj = ext_objects / (name[len("python/"):] + ".o")
        else:
            obj = core_objects / (name + ".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([CC, "-c", "-I", str(tree / "src"),
                        "-I", str(tree / "include"), "-o", str(obj),
                        str(tree / name)], check=True)
    for name in extra_objects:  # an object of no listed file
        obj = core_objects / name
        obj.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(core_objects / "src" / "low.c.o", obj)
    r = subprocess.run([sys.executable, CHECK, "--table",
                        str(tree / "floors.txt"), "--root", str(tree),
                        "--objects", str(core_objects),
                        "--objects", str(ext_objects)],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def changed(edits):
    """CLEAN with some files added or replaced."""
    return {**CLEAN, **edits}


def lines_with(out, *words):
    return [line for line in out.splitlines()
            if all(w in line for w in words)]


def test_clean_tree_passes(tmp_path):
    rc, out = run_check(tmp_path)
    assert rc == 0, out
    assert out.startswith(
        "layering: clean: 5 files on 3 floors in 2 houses"), out
    assert len(out.splitlines()) == 1, out


def test_upward_include_fails(tmp_path):
    rc, out = run_check(tmp_path, changed({"src/low.c": """\
        #include "low.h"
        #include "high.h"
        int usmipc__low(void) { return 1; }
        """}))
    assert rc == 1, out
    found = lines_with(out, "upward include: src/low.c [core 1 low]",
                       '"high.h"', "src/high.h [core 2 high]")
    assert len(found) == 1, out


def test_upward_call_through_local_extern_fails(tmp_path):
    # No include at all: only the object file shows the call.
    rc, out = run_check(tmp_path, changed({"src/low.c": """\
        #include "low.h"
        extern int usmipc__high(void);
        int usmipc__low(void) { return 1; }
        int usmipc__low_twice(void) { return usmipc__high() * 2; }
        """}))
    assert rc == 1, out
    assert not lines_with(out, "include:"), out
    found = lines_with(out, "upward call: src/low.c [core 1 low",
                       "-> src/high.c [core 2 high", ": usmipc__high")
    assert len(found) == 1, out
    # and high.c calls low.c back: a circle of the two
    assert lines_with(
        out, "circle of 2 files [core]: src/high.c, src/low.c"), out


def test_upward_call_through_a_header_that_includes_a_higher_one(tmp_path):
    files = changed({
        "src/mid.h": """\
            #ifndef MID_H
            #define MID_H
            #include "high.h"
            #endif
            """,
        "src/low.c": """\
            #include "mid.h"
            int usmipc__low(void) { return 1; }
            int usmipc__low_twice(void) { return usmipc__high() * 2; }
            """})
    table = TABLE.replace("src/low.c src/low.h", "src/low.c src/low.h "
                          "src/mid.h")
    rc, out = run_check(tmp_path, files, table)
    assert rc == 1, out
    assert lines_with(out, "upward include: src/mid.h [core 1 low]",
                      '"high.h"', "src/high.h [core 2 high]"), out
    assert lines_with(out, "upward call: src/low.c [core 1 low",
                      "-> src/high.c [core 2 high", ": usmipc__high"), out


def test_circle_on_one_floor_fails(tmp_path):
    files = changed({
        "src/a.c": """\
            int usmipc__b(int);
            int usmipc__a(int n) { return n ? usmipc__b(n - 1) : 0; }
            """,
        "src/b.c": """\
            int usmipc__a(int);
            int usmipc__b(int n) { return n ? usmipc__a(n - 1) : 1; }
            """})
    table = TABLE.replace("1 low:  src/low.c", "1 low:  src/a.c src/b.c "
                          "src/low.c")
    rc, out = run_check(tmp_path, files, table)
    assert rc == 1, out
    assert lines_with(out, "circle of 2 files [core]: src/a.c, src/b.c"), out
    assert lines_with(out, "src/a.c -> src/b.c: usmipc__b"), out
    assert lines_with(out, "src/b.c -> src/a.c: usmipc__a"), out
    assert lines_with(out, "call forward on its floor: src/a.c",
                      "-> src/b.c", "usmipc__b"), out


def test_circle_the_floors_allow_still_fails(tmp_path):
    # Two headers of one floor that include each other: no floor is
    # crossed, but they form a circle.
    files = changed({
        "src/a.h": """\
            #ifndef A_H
            #define A_H
            #include "b.h"
            #endif
            """,
        "src/b.h": """\
            #ifndef B_H
            #define B_H
            #include "a.h"
            #endif
            """})
    table = TABLE.replace("src/low.c src/low.h", "src/low.c src/low.h "
                          "src/a.h src/b.h")
    rc, out = run_check(tmp_path, files, table)
    assert rc == 1, out
    assert lines_with(out, "circle of 2 files [core]: src/a.h, src/b.h"), out
    assert not lines_with(out, "upward"), out


def test_file_missing_from_the_table_fails(tmp_path):
    files = changed({"src/extra.c": "int usmipc__extra(void) { return 3; }\n"})
    rc, out = run_check(tmp_path, files)
    assert rc == 1, out
    assert lines_with(out, "unlisted: src/extra.c", "[core]"), out


def test_file_gone_from_the_tree_fails(tmp_path):
    table = TABLE.replace("src/high.c src/high.h",
                          "src/high.c src/high.h src/gone.c")
    rc, out = run_check(tmp_path, table=table)
    assert rc == 1, out
    assert lines_with(out, "vanished: src/gone.c"), out


def test_extension_calling_an_internal_symbol_fails(tmp_path):
    rc, out = run_check(tmp_path, changed({"python/usmipc/_ext/ext.c": """\
        #include "usmipc.h"
        int usmipc__low(void);
        int ext_entry(void) { return usmipc_pub() + usmipc__low(); }
        """}))
    assert rc == 1, out
    found = lines_with(out, "private call: python/usmipc/_ext/ext.c "
                       "[extension 1 all] -> src/low.c [core 1 low]",
                       ": usmipc__low:")
    assert len(found) == 1, out
    # usmipc_pub, the public call beside it, is no fault
    assert "usmipc_pub" not in found[0], out


def test_extension_including_a_core_header_fails(tmp_path):
    rc, out = run_check(tmp_path, changed({"python/usmipc/_ext/ext.c": """\
        #include "usmipc.h"
        #include "low.h"
        int ext_entry(void) { return usmipc_pub(); }
        """}))
    assert rc == 1, out
    assert lines_with(out, "private include: python/usmipc/_ext/ext.c",
                      '"low.h"', "src/low.h [core 1 low]"), out


def test_core_calling_the_extension_fails(tmp_path):
    rc, out = run_check(tmp_path, changed({"src/high.c": """\
        #include "high.h"
        #include "usmipc.h"
        int ext_entry(void);
        int usmipc__high(void) { return usmipc__low() + 1; }
        int usmipc_pub(void) { return usmipc__high(); }
        int usmipc__up(void) { return ext_entry(); }
        """}))
    assert rc == 1, out
    assert lines_with(out, "upward call: src/high.c",
                      "-> python/usmipc/_ext/ext.c", ": ext_entry"), out


def test_object_of_a_moved_file_is_ignored(tmp_path):
    # A build folder keeps the object of a file that has since moved; it
    # defines the same symbols as the file's new object, and is no fault.
    rc, out = run_check(tmp_path, extra_objects=["src/old/low.c.o"])
    assert rc == 0, out
    assert "1 object(s) of no listed file ignored" in out, out


def test_malformed_table_cannot_run(tmp_path):
    rc, out = run_check(tmp_path, table=TABLE.replace("2 high:", "high:"))
    assert rc == 2, out
    assert "floors.txt:3:" in out, out
    rc, out = run_check(tmp_path, table=TABLE.replace("2 high:", "1 high:"))
    assert rc == 2, out
    assert "number the floors of [core] lowest first" in out, out
