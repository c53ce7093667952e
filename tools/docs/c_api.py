"""The C API reference page, made from include/usmipc.h at build time.

The header is the reference: one doc block (a /* ... */ comment) directly
above each call, section comments (/* ---- title ---- ... */) between
groups of calls, and the error codes' X-macro table in usmipc/errno.h. This
module reads them and writes the Markdown pages (api/c.md, an overview,
and one page per group of sections, PAGES); a public call without its
own doc block is an error, which fails the site's build
(tools/docs/hooks.py) and tests/python/test_doc_blocks.py.

Between a call's doc block and the call there may be the #defines and
typedefs it takes (usmipc_malloc_flags' flags, usmipc_pool_get_info's
struct), but no blank line and no other call.

    python tools/docs/c_api.py [--check] [OUTPUT_FOLDER]
"""
import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "usmipc.h"
ERRNO = ROOT / "include" / "usmipc" / "errno.h"
VERSION = ROOT / "include" / "usmipc" / "version.h"


@dataclasses.dataclass
class Item:
    kind: str  # comment, section, define, decl, blank
    text: str
    line: int


@dataclasses.dataclass
class Entry:
    kind: str        # section, function, type
    names: list
    doc: str         # the doc block's text, comment markers removed
    code: list       # declarations as written
    line: int


def strip_comment(text):
    """The text of a /* ... */ comment, one line per line."""
    body = text[2:-2]
    lines = body.split("\n")
    out = []
    for i, line in enumerate(lines):
        if i > 0:
            line = re.sub(r"^\s*\* ?", "", line, count=1)
        elif line.startswith(" "):
            line = line[1:]
        out.append(line.rstrip())
    while out and not out[-1].strip():
        out.pop()
    while out and not out[0].strip():
        out.pop(0)
    return "\n".join(out)


def tokenize(text):
    """The header's top-level items, in order."""
    # The C++ guard, the visibility macro and the include guard are not API.
    text = re.sub(r"#ifdef __cplusplus\n.*?#endif\n",
                  lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"#if defined\(__GNUC__\)\n.*?#endif\n",
                  lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    items, i, line, n = [], 0, 1, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if c == "\n":
            if at_line_start:
                items.append(Item("blank", "", line))
            at_line_start = True
            line += 1
            i += 1
        elif c in " \t":
            i += 1
        elif text.startswith("/*", i):
            j = text.index("*/", i) + 2
            body = text[i:j]
            kind = "section" if re.match(r"/\* ?-{4}", body) else "comment"
            items.append(Item(kind, body, line))
            line += body.count("\n")
            i, at_line_start = j, False
        elif c == "#":
            j = i
            while True:
                j = text.index("\n", j)
                if text[j - 1] != "\\":
                    break
                j += 1
            directive = text[i:j]
            if re.match(r"#define USMIPC_(?!H\b|API\b|ERRNO_H|VERSION_H)",
                        directive):
                items.append(Item("define", directive, line))
            line += directive.count("\n")
            i, at_line_start = j, False
        else:
            # A declaration: up to its semicolon outside braces, comments
            # (a struct's field notes) included.
            j, depth = i, 0
            while True:
                if text.startswith("/*", j):
                    j = text.index("*/", j) + 2
                    continue
                ch = text[j]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and depth == 0:
                    break
                j += 1
            decl = text[i:j + 1]
            items.append(Item("decl", decl, line))
            line += decl.count("\n")
            i, at_line_start = j + 1, False
    return items


FUNCTION = re.compile(r"\bUSMIPC_API\b.*?\b(usmipc_\w+)\s*\(", re.S)
TYPEDEF = re.compile(r"\b(usmipc_\w+_t|usmipc_\w+_fn)\s*;\s*$"
                     r"|\(\*\s*(usmipc_\w+)\)")


def entries(text):
    """The page's entries and the calls that lack a doc block."""
    out, missing = [], []
    doc, code = None, []
    intro = None

    def flush():
        nonlocal doc, code
        if code:
            names = []
            for item in code:
                m = TYPEDEF.search(item.text)
                d = re.match(r"#define (\w+)", item.text)
                names.append(m.group(1) or m.group(2) if m else
                             d.group(1) if d else "?")
            out.append(Entry("type", names,
                             strip_comment(doc.text) if doc else "",
                             [c.text for c in code], code[0].line))
        doc, code = None, []

    for item in tokenize(text):
        if item.kind == "blank":
            flush()
        elif item.kind == "section":
            flush()
            body = strip_comment(item.text)
            first, _, rest = body.partition("\n")
            title = first.strip("- ").strip()
            if not title:  # the title went on after the dashes
                title, _, rest = rest.partition("\n")
            out.append(Entry("section", [title], rest.strip("\n"), [],
                             item.line))
        elif item.kind == "comment":
            if intro is None and not out:
                intro = strip_comment(item.text)
                continue
            if code:
                flush()
            doc = item
        elif item.kind == "define" or (item.kind == "decl"
                                       and not FUNCTION.search(item.text)):
            code.append(item)
        else:
            name = FUNCTION.search(item.text).group(1)
            if doc is None:
                missing.append(f"{HEADER.relative_to(ROOT)}:{item.line}: "
                               f"{name} has no doc block directly above it")
            out.append(Entry("function", [name],
                             strip_comment(doc.text) if doc else "",
                             [c.text for c in code] + [item.text], item.line))
            doc, code = None, []
    flush()
    return intro or "", out, missing


def error_codes(text):
    return re.findall(r'XX\((\w+),\s*(-?\w+),\s*"([^"]*)"\)', text)


# ---- Markdown -------------------------------------------------------------

def prose(text, functions, pages, here="c.md"):
    """A comment's text as Markdown: indented lines stay preformatted, "- "
    lines are a list, names of calls link to their entries (functions: name
    -> the page that has it; here: the page being written), docs/ paths to
    their pages, and everything else is escaped."""
    def inline(s):
        out, pos = [], 0
        for m in re.finditer(r"\b(?:usmipc_\w+|USMIPC_\w+|\w+\(\))(?:\(\))?"
                             r"|\bdocs/[\w.-]+\.md|(?<![\w)])\*\w+", s):
            out.append(escape(s[pos:m.start()]))
            word = m.group(0)
            if word.removesuffix("()") in functions:
                out.append(f"[`{word}`]({link(word.removesuffix('()'), functions, here)})")
            elif word.startswith("docs/") and word[5:] in pages:
                out.append(f"[{word}](../{word[5:]})")
            else:
                out.append(f"`{word}`")
            pos = m.end()
        out.append(escape(s[pos:]))
        return "".join(out)

    blocks, para, pre, lst = [], [], [], []

    def end():
        if para:
            blocks.append(inline(" ".join(para)))
            para.clear()
        if pre:
            blocks.append("```text\n" + "\n".join(pre) + "\n```")
            pre.clear()
        if lst:
            blocks.append("\n".join(f"- {inline(x)}" for x in lst))
            lst.clear()

    for line in text.split("\n"):
        if not line.strip():
            end()
        elif re.match(r"^ ?- ", line):
            if para or pre:
                end()
            lst.append(line.strip()[2:])
        elif lst and line.startswith("   "):
            lst[-1] += " " + line.strip()
        elif line.startswith("  "):
            if para or lst:
                end()
            pre.append(line)
        else:
            if pre or lst:
                end()
            para.append(line.strip())
    end()
    return "\n\n".join(blocks)


def declaration(text):
    """A declaration as the page shows it: without the visibility macro,
    continuation lines moved left by as much."""
    text = text.strip("\n")
    if not text.startswith("USMIPC_API "):
        return text
    cut = len("USMIPC_API ")
    lines = text[cut:].split("\n")
    return "\n".join([lines[0]] + [line[cut:] if line[:cut].isspace()
                                    else line for line in lines[1:]])


def escape(s):
    s = re.sub(r"([\\`*_\[\]#|])", r"\\\1", s)
    return s.replace("<", "&lt;").replace(">", "&gt;")


# The reference is split by topic so that no page is a long scroll (one
# page was 30,000 px at 1280 px wide): the sections of the header go to the
# page whose titles they start with; what comes before the first section
# (the shared types), "version and errors", the error codes and the version
# macros stay on the overview, api/c.md.
PAGES = [
    ("c-devices.md", "Devices, queues and memory",
     ("backends and devices", "queues", "memory", "pools",
      "PyTorch's CUDA allocator")),
    ("c-ipc.md", "IPC handles and events", ("IPC", "events")),
    ("c-release.md", "Release signals", ("release signals",)),
    ("c-bundles.md", "Bundles and updates", ("bundles", "updates")),
]


def page_of(section_title):
    for name, _, starts in PAGES:
        if section_title.startswith(starts):
            return name
    return "c.md"


def link(name, functions, here):
    page = functions[name]
    return f"#{name}" if page == here else f"{page}#{name}"


def render():
    """The pages ({file name under api/: Markdown}, the overview c.md
    first), and the calls without a doc block."""
    intro, page, missing = entries(HEADER.read_text())
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    # Where each entry goes: its section's page.
    placed, where = [], "c.md"
    for e in page:
        if e.kind == "section":
            where = page_of(e.names[0])
        placed.append((where, e))
    functions = {n: w for w, e in placed if e.kind == "function"
                 for n in e.names}
    # The overview opens with the types, so that its first entry is on the
    # first screen; the conventions and the index of calls close it.
    out = {"c.md": ["# C API", "",
                    "Made from `include/usmipc.h` when the site is built: "
                    "the header is the reference, one doc block per call. "
                    "[Conventions](#conventions) and [every call by topic]"
                    "(#calls-by-topic) are at the end of this page.", "",
                    "## Types", ""]}  # the entries before any section
    index = ["## Conventions", "", prose(intro, functions, pages), "",
             "## Calls by topic", ""]
    for name, title, _ in PAGES:
        calls = [n for w, e in placed if w == name and e.kind == "function"
                 for n in e.names]
        index.append(f"- [{title}]({name}): " + ", ".join(
            f"[`{n}`]({name}#{n})" for n in calls))
        out[name] = [f"# C API: {title.lower()[:1]}{title[1:]}", "",
                     "Made from `include/usmipc.h` when the site is built; "
                     "the conventions, types and error codes are on the "
                     "[overview](c.md).", ""]
    for where, e in placed:
        lines = out[where]
        if e.kind == "section":
            title = e.names[0]
            lines += [f"## {escape(title[:1].upper() + title[1:])}", ""]
            if e.doc:
                lines += [prose(e.doc, functions, pages, where), ""]
            continue
        title = ", ".join(f"`{n}`" for n in e.names)
        anchor = e.names[0]
        lines.append(f"### {title} {{#{anchor} data-toc-label=\"{anchor}\"}}")
        lines += [""] + [f'<a id="{n}"></a>' for n in e.names[1:]]
        lines += ["", "```c", "\n".join(declaration(c) for c in e.code),
                  "```", ""]
        if e.doc:
            lines += [prose(e.doc, functions, pages, where), ""]
    errno_doc = re.match(r"/\*.*?\*/", ERRNO.read_text(), re.S).group(0)
    lines = out["c.md"]
    lines += ["## Error codes", "", prose(strip_comment(errno_doc).split(
        "\n", 1)[1].strip(), functions, pages), "",
        "`usmipc_strerror(code)` gives the text, `usmipc_err_name(code)` the "
        "name (Python: `usmipc.strerror`, `usmipc.errorcode`).", "",
        "| name | value | text |", "|---|---|---|"]
    for name, value, text in error_codes(ERRNO.read_text()):
        lines.append(f"| <span id=\"USMIPC_{name}\">`USMIPC_{name}`</span> | "
                     f"`{value}` | {escape(text)} |")
    version = dict(re.findall(r"#define (USMIPC_VERSION_\w+) +(\S+)\n",
                              VERSION.read_text()))
    lines += ["", "## Version", "",
              "`include/usmipc/version.h` defines `USMIPC_VERSION_MAJOR`, "
              "`_MINOR`, `_PATCH`, `USMIPC_VERSION_STRING` "
              f"({escape(version.get('USMIPC_VERSION_STRING', '?'))}) and "
              "`USMIPC_VERSION_HEX` (`major << 16 | minor << 8 | patch`), the "
              "release a program was compiled against; "
              f"[`usmipc_version`]({link('usmipc_version', functions, 'c.md')})"
              " gives the one loaded.", ""] + index + [""]
    return {name: "\n".join(lines) for name, lines in out.items()}, missing


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    pages, missing = render()
    for m in missing:
        print(m, file=sys.stderr)
    if args:  # a folder: one file per page
        out = pathlib.Path(args[0])
        out.mkdir(parents=True, exist_ok=True)
        for name, page in pages.items():
            (out / name).write_text(page)
    elif not check:
        sys.stdout.write("\n\n".join(pages.values()))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
