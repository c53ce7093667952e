"""MkDocs hooks (mkdocs.yml): the pages made at build time, and the words
after a fence's language, which tests/python/test_doc_blocks.py reads and
the site does not show.

- api/c.md and api/c-*.md: made from include/usmipc.h (tools/docs/c_api.py),
  an overview and one page per topic; a public call
  without a doc block is a warning, so the strict build fails.
- index.md, benchmarks.md, changelog.md: README.md, bench/RESULTS.md and
  CHANGELOG.md, whose links
  are rewritten for the site (docs/x.md -> x.md; other files of the
  repository they show, such as plots, are copied in).
"""
import logging
import pathlib
import posixpath
import re
import sys

from mkdocs.structure.files import File

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import c_api  # noqa: E402

log = logging.getLogger("mkdocs.plugins.usmipc")

# Pages whose source lives outside docs/: site path -> repository path.
OUTSIDE = {"index.md": "README.md", "benchmarks.md": "bench/RESULTS.md",
           "changelog.md": "CHANGELOG.md"}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
FENCE_WORDS = re.compile(r"^([ \t]*(?:`{3,}|~{3,})[\w+-]+)[ \t]+[^\n`]*$",
                         re.M)


def on_files(files, config):
    pages, missing = c_api.render()
    for problem in missing:
        log.warning("C API: %s", problem)
    for name, page in pages.items():
        files.append(File.generated(config, "api/" + name, content=page))
    for site_path, repo_path in OUTSIDE.items():
        text, assets = rewrite_links((ROOT / repo_path).read_text(),
                                     repo_path, site_path)
        files.append(File.generated(config, site_path, content=text))
        for asset in assets:
            files.append(File.generated(config, asset,
                                        abs_src_path=str(ROOT / asset)))
    return files


def rewrite_links(text, repo_path, site_path):
    """Links of a page from outside docs/, made relative to its place in the
    site; the repository files it links that are not pages (its assets)."""
    pages = {v: k for k, v in OUTSIDE.items()}
    assets = []

    def one(m):
        target = m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path, hash_, anchor = target.partition("#")
        repo = posixpath.normpath(posixpath.join(
            posixpath.dirname(repo_path), path))
        if repo.startswith("docs/"):
            site = repo[len("docs/"):]
        elif repo in pages:
            site = pages[repo]
        elif (ROOT / repo).is_file():
            site = repo
            assets.append(repo)
        else:
            return m.group(0)  # left for the strict build to report
        rel = posixpath.relpath(site, posixpath.dirname(site_path) or ".")
        return m.group(1) + rel + hash_ + anchor + m.group(3)

    return LINK.sub(one, text), assets


def on_page_markdown(markdown, page, config, files):
    return FENCE_WORDS.sub(r"\1", markdown)
