#!/usr/bin/env python3
"""The layering check: every file calls and includes only what stands below it.

Which file stands where is declared in one table (tools/layering/floors.txt;
its header comment describes the format), never derived from the include
graph. The check reads the tree's `#include "..."` lines and, with nm, the
symbols each object file defines and needs, and fails on:

  - a file under a house's root (src/, python/usmipc/_ext/) that the table
    does not list, or lists twice, or a listed file that is gone;
  - an include of a header that stands higher (a higher floor, a higher
    house; the extension may include only the public headers, include/);
  - a reference (a call, or a use of a variable) from an object to a symbol
    defined by a file that stands higher: a higher floor, or later on the
    same floor; the extension may reference only the core's public symbols
    (usmipc_..., never usmipc__...);
  - any circle: a strongly connected component of more than one file in the
    graph of includes and references, even where the floors would allow it.

Each violation is one line naming the two files, their floors, and the
include or the symbols (a circle's line names its files; its ties follow,
indented, one a line). Exit status: 0 clean (one summary line), 1 when
anything is wrong, 2 when the check cannot run (a malformed table, nm
missing).

    python3 tools/layering/check.py --table tools/layering/floors.txt \\
        --root . --objects build/CMakeFiles/usmipc_objects.dir \\
        --objects build/CMakeFiles/usmipc-helper.dir \\
        --objects build-layering/python/CMakeFiles/_usmipc.dir

Each --objects folder is searched for *.o files; an object is mapped back to
its source by path suffix (CMake names `src/util/error.c`'s object
`.../usmipc_objects.dir/src/util/error.c.o`, the extension's `module.c`
`.../_usmipc.dir/usmipc/_ext/module.c.o`). Objects whose source the table
does not list (a stale object of a file that moved, say) are ignored and
counted in the summary. Needs only the Python standard library and nm
(binutils; another one through NM=).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

# Headers under this folder are the public API: they stand below every house
# and any file may include them.
PUBLIC_DIR = "include"
# A house above another may reference only its public symbols: names with
# this prefix, and never with the private one.
PUBLIC_PREFIX = "usmipc_"
PRIVATE_PREFIX = "usmipc__"

SOURCE_EXTENSIONS = (".c", ".h")
# nm's letters for a symbol an object defines for others (upper case: global;
# i: GNU indirect function; u: GNU unique global).
DEFINED_TYPES = set("TDBRCVWGSiu")
# and for one it needs: U, and a weak reference without a value.
UNDEFINED_TYPES = set("U")
WEAK_TYPES = set("vw")


class TableError(Exception):
    pass


class House:
    def __init__(self, name, roots, index, line):
        self.name = name
        self.roots = roots
        self.index = index
        self.line = line
        self.floors = []


class Floor:
    def __init__(self, house, number, name, index, line):
        self.house = house
        self.number = number
        self.name = name
        self.index = index
        self.line = line
        self.files = []


class Place:
    """Where one file stands: its house, its floor, and for a .c file its
    position among the floor's .c files (headers have none)."""

    def __init__(self, path, floor, position):
        self.path = path
        self.floor = floor
        self.position = position

    @property
    def house(self):
        return self.floor.house

    def label(self, with_position=False):
        text = f"{self.house.name} {self.floor.number} {self.floor.name}"
        if with_position and self.position is not None:
            text += f", #{self.position + 1} on the floor"
        return f"[{text}]"


# ---- the table -------------------------------------------------------------

HOUSE_RE = re.compile(r"^\[([A-Za-z0-9_-]+)\]\s*(.*)$")
FLOOR_RE = re.compile(r"^(\d+)\s+([A-Za-z0-9_.-]+)\s*:\s*(.*)$")


def parse_table(path):
    """Returns the houses, lowest first. Raises TableError on a malformed
    line (the table cannot be trusted at all then)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise TableError(f"{path}: cannot read the table: {e.strerror}")
    houses = []
    floor = None
    for number, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0].rstrip()
        if not text.strip():
            continue
        where = f"{path}:{number}"
        if raw[0] in " \t":
            if floor is None:
                raise TableError(f"{where}: an indented line continues a "
                                 "floor's list, but no floor is open here")
            floor.files.extend((f, number) for f in text.split())
            continue
        m = HOUSE_RE.match(text)
        if m:
            roots = [r.rstrip("/") for r in m.group(2).split()]
            if not roots:
                raise TableError(f"{where}: house [{m.group(1)}] names no "
                                 "root folder (e.g. `[core] src/`)")
            if any(h.name == m.group(1) for h in houses):
                raise TableError(f"{where}: house [{m.group(1)}] is declared "
                                 "twice")
            houses.append(House(m.group(1), roots, len(houses), number))
            floor = None
            continue
        m = FLOOR_RE.match(text)
        if m:
            if not houses:
                raise TableError(f"{where}: a floor before any [house] line")
            house = houses[-1]
            level = int(m.group(1))
            if house.floors and level <= house.floors[-1].number:
                raise TableError(
                    f"{where}: floor {level} after floor "
                    f"{house.floors[-1].number}: number the floors of "
                    f"[{house.name}] lowest first, each higher than the last")
            if any(fl.name == m.group(2) for fl in house.floors):
                raise TableError(f"{where}: [{house.name}] has two floors "
                                 f"named {m.group(2)}")
            floor = Floor(house, level, m.group(2), len(house.floors), number)
            house.floors.append(floor)
            floor.files.extend((f, number) for f in m.group(3).split())
            continue
        raise TableError(f"{where}: neither `[house] root/`, `N name: files` "
                         f"nor an indented continuation: {raw.strip()!r}")
    if not houses:
        raise TableError(f"{path}: the table declares no house")
    return houses


def under(path, folder):
    return path == folder or path.startswith(folder + "/")


def place_files(houses, root, problems):
    """Maps each listed file to its Place; records table problems: a file
    listed twice, a listed file that is gone or outside its house's roots,
    a file under a root that is not listed."""
    places = {}
    for house in houses:
        for floor in house.floors:
            position = 0
            for name, line in floor.files:
                path = os.path.normpath(name)
                where = f"line {line}"
                if not path.endswith(SOURCE_EXTENSIONS):
                    problems.append(("table", f"table: {path} ({where}) is "
                                     "neither a .c nor a .h file"))
                    continue
                if path in places:
                    first = places[path]
                    problems.append(("table", f"table: {path} is listed "
                                     f"twice: {first.label()} and "
                                     f"[{house.name} {floor.number} "
                                     f"{floor.name}] ({where})"))
                    continue
                if not any(under(path, r) for r in house.roots):
                    problems.append(("table", f"table: {path} ({where}) is "
                                     f"listed in [{house.name}] but lies "
                                     f"outside its roots "
                                     f"({', '.join(house.roots)})"))
                if not os.path.isfile(os.path.join(root, path)):
                    problems.append(("table", f"vanished: {path} is in the "
                                     f"table ({where}) but not in the tree"))
                is_c = path.endswith(".c")
                places[path] = Place(path, floor, position if is_c else None)
                if is_c:
                    position += 1
    for house in houses:
        for top in house.roots:
            for dirpath, dirnames, filenames in os.walk(os.path.join(root,
                                                                     top)):
                dirnames[:] = sorted(d for d in dirnames
                                     if not d.startswith("."))
                for fn in sorted(filenames):
                    if not fn.endswith(SOURCE_EXTENSIONS):
                        continue
                    path = os.path.relpath(os.path.join(dirpath, fn), root)
                    if path not in places:
                        problems.append((
                            "table", f"unlisted: {path} lies under "
                            f"[{house.name}]'s root {top}/ but the table "
                            "places it on no floor: add it where it stands"))
    return places


# ---- includes --------------------------------------------------------------

INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)
# A comment, or a string or character literal (skipped whole, so that a
# "/*" inside one opens no comment).
COMMENT_RE = re.compile(r"/\*.*?\*/|//[^\n]*"
                        r"""|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", re.S)


def quoted_includes(text):
    """(line, name) of each `#include "name"` outside comments."""
    def blank(m):
        if m.group(0)[0] in "\"'":
            return m.group(0)
        return re.sub(r"[^\n]", " ", m.group(0))
    text = COMMENT_RE.sub(blank, text)
    for m in INCLUDE_RE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1)


def resolve_include(root, includer, name, houses, own_house):
    """Where `#include "name"` in `includer` lands: beside the includer,
    then the includer's house's roots, then include/, then the other
    houses' roots (so that reaching across is seen, not missed)."""
    folders = [os.path.dirname(includer)]
    if own_house is not None:
        folders += own_house.roots
    folders.append(PUBLIC_DIR)
    for house in houses:
        if house is not own_house:
            folders += house.roots
    for folder in folders:
        path = os.path.normpath(os.path.join(folder, name))
        if os.path.isfile(os.path.join(root, path)):
            return path
    return None


def public_headers(root):
    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root,
                                                             PUBLIC_DIR)):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".h"):
                found.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return found


# ---- symbols ---------------------------------------------------------------

def object_files(folder):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".o"):
                yield os.path.join(dirpath, fn)


def source_of_object(obj, folder, sources):
    """The listed .c file an object was compiled from: the one whose path
    ends with the object's path inside its folder, less `.o` (CMake writes
    `../` as `__/`, dropped here); None if no listed file does."""
    rel = os.path.relpath(obj, folder)[:-len(".o")].replace(os.sep, "/")
    tail = "/".join(p for p in rel.split("/") if p not in ("__", "."))
    matches = [s for s in sources if s == tail or s.endswith("/" + tail)]
    return matches[0] if len(matches) == 1 else None


def read_symbols(nm, obj):
    """(defined, needed) global symbol names of one object file."""
    r = subprocess.run([nm, "-P", obj], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{nm} -P {obj} failed: {r.stderr.strip()}")
    defined, needed = set(), set()
    for line in r.stdout.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        name, kind = fields[0], fields[1]
        if kind in DEFINED_TYPES:
            defined.add(name)
        elif kind in UNDEFINED_TYPES or (kind in WEAK_TYPES
                                         and len(fields) == 2):
            needed.add(name)
    return defined, needed


# ---- the graph -------------------------------------------------------------

def circles(nodes, edges):
    """Strongly connected components of more than one node (Tarjan's
    algorithm, iterative so that a deep graph cannot overflow the stack)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def order_key(place):
    """A .c file's place in the strict total order "below"."""
    return (place.house.index, place.floor.index, place.position)


def names(symbols, limit=8):
    symbols = sorted(symbols)
    text = ", ".join(symbols[:limit])
    if len(symbols) > limit:
        text += f" and {len(symbols) - limit} more"
    return text


def check(args):
    problems = []  # (kind, line)
    try:
        houses = parse_table(args.table)
    except TableError as e:
        print(f"layering: {e}", file=sys.stderr)
        return 2
    root = args.root
    places = place_files(houses, root, problems)
    edges = {}     # file -> set of files it includes or references
    ties = {}      # (from, to) -> list of words for the circle report
    include_pairs, call_pairs = set(), set()

    def tie(a, b, word):
        edges.setdefault(a, set()).add(b)
        ties.setdefault((a, b), []).append(word)

    # Includes: the listed files and the public headers.
    public = public_headers(root)
    for path in sorted(places) + public:
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            continue
        with open(full, encoding="utf-8", errors="replace") as f:
            text = f.read()
        me = places.get(path)
        for line, name in quoted_includes(text):
            target = resolve_include(root, path, name, houses,
                                     me.house if me else None)
            at = f'includes "{name}" (line {line})'
            if target is None:
                problems.append(("include", f"unresolved include: {path} "
                                 f"{at}, which is found neither beside it "
                                 "nor on any house's or include/'s path"))
                continue
            if target != path:
                include_pairs.add((path, target))
                tie(path, target, f'#include "{name}"')
            if me is None:  # a public header
                if not under(target, PUBLIC_DIR):
                    problems.append(("include", f"upward include: {path} "
                                     f"[public] {at} = {target}: a public "
                                     f"header may include only {PUBLIC_DIR}/"))
                continue
            if under(target, PUBLIC_DIR):
                continue
            it = places.get(target)
            if it is None:
                problems.append(("include", f"include of an unplaced file: "
                                 f"{path} {me.label()} {at} = {target}, which "
                                 "no floor of the table holds"))
                continue
            if it.house is not me.house:
                if it.house.index > me.house.index:
                    problems.append(("include", f"upward include: {path} "
                                     f"{me.label()} {at} = {target} "
                                     f"{it.label()}"))
                else:
                    problems.append(("include", f"private include: {path} "
                                     f"{me.label()} {at} = {target} "
                                     f"{it.label()}: [{me.house.name}] may "
                                     f"include only [{it.house.name}]'s "
                                     f"public headers ({PUBLIC_DIR}/)"))
                continue
            if target.endswith(".h"):
                ok = it.floor.index <= me.floor.index
            else:  # an included .c file stands where a reference would
                mine = order_key(me) if me.position is not None else \
                    (me.house.index, me.floor.index, float("inf"))
                ok = order_key(it) < mine
            if not ok:
                problems.append(("include", f"upward include: {path} "
                                 f"{me.label()} {at} = {target} "
                                 f"{it.label()}"))

    # Symbols, from the objects.
    nm = os.environ.get("NM", "nm")
    if shutil.which(nm) is None:
        print(f"layering: {nm} not found: the symbol check reads object "
              "files with nm (binutils); install it or set NM=",
              file=sys.stderr)
        return 2
    sources = sorted(p for p in places if p.endswith(".c"))
    objects_of = {}
    ignored = []
    for folder in args.objects:
        if not os.path.isdir(folder):
            print(f"layering: --objects {folder}: no such folder (build "
                  "first: make layering builds what it needs)",
                  file=sys.stderr)
            return 2
        for obj in object_files(folder):
            src = source_of_object(obj, folder, sources)
            if src is None:
                ignored.append(obj)
            else:
                objects_of.setdefault(src, []).append(obj)
    for src in sources:
        objs = objects_of.get(src, [])
        if not objs and os.path.isfile(os.path.join(root, src)):
            problems.append(("objects", f"no object: {src} "
                             f"{places[src].label()} has no object file in "
                             "the --objects folders: build it, or name the "
                             "folder its object is in"))
        elif len(objs) > 1:
            problems.append(("objects", f"two objects: {src} was compiled "
                             f"into {', '.join(objs)}: pass one build's "
                             "folders only"))
    defined_by = {}  # symbol -> [source]
    needs = {}       # source -> set of symbols
    for src, objs in sorted(objects_of.items()):
        if len(objs) != 1:
            continue
        try:
            defined, needed = read_symbols(nm, objs[0])
        except RuntimeError as e:
            print(f"layering: {e}", file=sys.stderr)
            return 2
        for sym in defined:
            defined_by.setdefault(sym, []).append(src)
        needs[src] = needed
    refs = {}  # (from, to) -> set of symbols
    for src, needed in needs.items():
        for sym in needed:
            for target in defined_by.get(sym, ()):
                if target != src:
                    refs.setdefault((src, target), set()).add(sym)
    for (src, target), syms in sorted(refs.items()):
        call_pairs.add((src, target))
        tie(src, target, names(syms, 4))
        me, it = places[src], places[target]
        line = (f"{src} {me.label(True)} -> {target} {it.label(True)}: "
                f"{names(syms)}")
        if it.house is not me.house:
            if it.house.index > me.house.index:
                problems.append(("upward", f"upward call: {line}"))
            else:
                private = {s for s in syms if s.startswith(PRIVATE_PREFIX)
                           or not s.startswith(PUBLIC_PREFIX)}
                if private:
                    problems.append((
                        "private", f"private call: {src} {me.label()} -> "
                        f"{target} {it.label()}: {names(private)}: "
                        f"[{me.house.name}] may use only [{it.house.name}]'s "
                        f"public API ({PUBLIC_PREFIX}..., never "
                        f"{PRIVATE_PREFIX}...)"))
        elif it.floor.index > me.floor.index:
            problems.append(("upward", f"upward call: {line}"))
        elif it.floor.index == me.floor.index and \
                it.position > me.position:
            problems.append(("forward", f"call forward on its floor: {line} "
                             f"({target} is listed after {src})"))

    # Circles.
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    found_circles = circles(nodes, edges)
    for component in found_circles:
        members = set(component)
        houses_in = sorted({places[f].house.name if f in places else "public"
                            for f in component})
        lines = [f"circle of {len(component)} files "
                 f"[{', '.join(houses_in)}]: {', '.join(component)}"]
        for (a, b), words in sorted(ties.items()):
            if a in members and b in members:
                lines.append(f"    {a} -> {b}: {'; '.join(words)}")
        problems.append(("circle", "\n".join(lines)))

    n_floors = sum(len(h.floors) for h in houses)
    arrows = len(ties)
    summary = (f"{len(places)} files on {n_floors} floors in {len(houses)} "
               f"houses, {arrows} arrows ({len(call_pairs)} referencing, "
               f"{len(include_pairs)} including)")
    if ignored:
        summary += (f"; {len(ignored)} object(s) of no listed file ignored")
    if not problems:
        print(f"layering: clean: {summary}; nothing upward, no circle")
        return 0
    for _, line in problems:
        print(line)
    counts = {}
    for kind, _ in problems:
        counts[kind] = counts.get(kind, 0) + 1
    words = {"table": "table problems", "include": "include problems",
             "objects": "object problems", "upward": "upward calls",
             "forward": "forward calls on a floor",
             "private": "private calls across houses", "circle": "circles"}
    sizes = [str(len(c)) for c in found_circles]
    parts = []
    for kind in ("table", "include", "objects", "upward", "forward",
                 "private", "circle"):
        if counts.get(kind):
            part = f"{counts[kind]} {words[kind]}"
            if kind == "circle":
                part += f" (of {', '.join(sizes)} files)"
            parts.append(part)
    print(f"layering: FAILED: {'; '.join(parts)}; {summary}")
    return 1


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Check that every file includes and references only "
        "files below it, as the floors table declares.")
    p.add_argument("--table", required=True,
                   help="the floors table (tools/layering/floors.txt)")
    p.add_argument("--root", default=".",
                   help="the tree's root; the table's paths are relative "
                   "to it (default: .)")
    p.add_argument("--objects", action="append", required=True,
                   metavar="FOLDER",
                   help="a folder searched for object files (*.o); repeat "
                   "for each build target's folder")
    return check(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
