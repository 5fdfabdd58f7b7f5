"""Sphinx extension: the book's pages load with no errors in the browser's console.

- sphinx-thebe 0.3.1, which Jupyter Book always loads, registers its inline configuration script
  (`const THEBE_JS_URL = ...`) at start-up and again before reading the documents; Sphinx keeps
  both because one has the file name '' and the other None, and the second `const` is an error
  on every page (sphinx-togglebutton's inline script is repeated the same way, harmlessly). The
  repeated copies are dropped before a page is written.
- The pydata theme under sphinx-book-theme reports "invalid theme mode" on a reader's first visit
  unless its template has a default mode; Jupyter Book gives none, so the book starts in light
  mode.
"""


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


def setup(app):
    app.connect("config-inited", default_to_light_mode)
    app.connect("html-page-context", drop_repeated_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
