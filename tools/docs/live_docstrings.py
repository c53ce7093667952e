"""A griffe extension (mkdocs.yml) for the Python API reference.

- The C extension usmipc._usmipc: griffe reads its signatures from the
  stubs (_usmipc.pyi), which carry no texts; the texts are in the C
  source, and this copies them from the module that `make python`
  installed, so that the reference shows what help() shows.
- Every docstring is plain text (or a little reST), and mkdocstrings reads
  Markdown: a first line restating the signature (a C method's
  "to_bytes() -> bytes: ...") is dropped, ``code`` and :role:`code` become
  `code`, a "::" paragraph's indented block a code block, and dunder names
  and asterisks are kept from turning into emphasis.
"""
import importlib
import inspect
import re

import griffe


class LiveDocstrings(griffe.Extension):
    def on_package(self, *, pkg, loader, **kwargs):
        if pkg.name != "usmipc":
            return
        fill(pkg["_usmipc"], importlib.import_module("usmipc._usmipc"))
        convert(pkg, set())


def documented(value):
    return (isinstance(value, type) or inspect.isroutine(value)
            or inspect.isdatadescriptor(value)
            or inspect.ismethoddescriptor(value))


def fill(obj, live):
    for name, member in obj.members.items():
        if member.is_alias or name.startswith("__"):
            continue
        value = inspect.getattr_static(live, name, None)
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if value is None or not documented(value):
            continue
        doc = getattr(value, "__doc__", None)
        if isinstance(value, type) and "__doc__" not in vars(value):
            doc = None  # not inherited: RuntimeError's text is not ours
        if doc and not member.docstring:
            member.docstring = griffe.Docstring(inspect.cleandoc(doc),
                                                parent=member)
        if member.is_class:
            fill(member, value)


def convert(obj, seen):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if obj.docstring:
        obj.docstring.value = markdown(obj.docstring.value, obj.name)
    for member in obj.members.values():
        if not member.is_alias:
            convert(member, seen)


CODE = re.compile(r"(`[^`\n]+`)")


def markdown(text, name):
    text, restated = re.subn(
        rf"\A{re.escape(name)}\([^)\n]*\)(?:\s*->\s*[^:\n]+)?"
        r"(?::[ \t]*|[ \t]*\n|\Z)", "", text)
    if restated:
        text = text[:1].upper() + text[1:]
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            out.append(inline(line.rstrip()[:-1]))
            j = i + 1
            block = []
            while j < len(lines) and (not lines[j].strip()
                                      or lines[j].startswith(" ")):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```python", inspect.cleandoc("\n".join(block)),
                    "```", ""]
            i = j
            continue
        out.append(inline(line))
        i += 1
    return "\n".join(out)


def inline(line):
    parts = CODE.split(line)
    for k in range(0, len(parts), 2):  # outside code spans
        parts[k] = re.sub(r"(?<![\w`])(__\w+__)", r"`\1`", parts[k])
        parts[k] = parts[k].replace("*", r"\*")
    return "".join(parts)
