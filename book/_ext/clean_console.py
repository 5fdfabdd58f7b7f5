"""Sphinx extension: the book's pages load with no errors in the browser's console.

- sphinx-thebe 0.3.1, which Jupyter Book always loads, registers its inline configuration script
  (`const THEBE_JS_URL = ...`) at start-up and again before reading the documents; Sphinx keeps
  both because one has the file name '' and the other None, and the second `const` is an error
  on every page (sphinx-togglebutton's inline script is repeated the same way, harmlessly). The
  repeated copies are dropped before a page is written.
- The pydata theme under sphinx-book-theme reports "invalid theme mode" on a reader's first visit
  unless its template has a default mode; Jupyter Book gives none, so the book starts in light
  mode.
- The site's root, index.html, is a redirect to the first page that sphinx-external-toc writes if
  none exists, with no icon: the browser then asks for /favicon.ico, a 404 in its console. The
  book writes that redirect first, with the book's icon.
"""
from pathlib import Path


def drop_repeated_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = (getattr(script, "filename", script) or "",
               tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def default_to_light_mode(app, config):
    config.html_context.setdefault("default_mode", "light")


def redirect_with_icon(app, exception):
    if exception is None and app.builder.format == "html" and app.config.master_doc != "index":
        icon = Path(app.config.html_favicon).name  # Sphinx copies it into _static
        (Path(app.outdir) / "index.html").write_text(
            f'<meta http-equiv="Refresh" content="0; url={app.config.master_doc}.html" />\n'
            f'<link rel="icon" href="_static/{icon}" />\n', encoding="utf8")


def setup(app):
    app.connect("config-inited", default_to_light_mode)
    app.connect("html-page-context", drop_repeated_scripts)
    app.connect("build-finished", redirect_with_icon, priority=400)  # before the toc's, at 500
    return {"parallel_read_safe": True, "parallel_write_safe": True}
