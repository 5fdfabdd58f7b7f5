// Runs between require.js and the ipywidgets HTML manager (embed-amd.js) on pages with widgets.
//
// 1. The manager finds its icon fonts next to the AMD module it is loaded as
//    ("@jupyter-widgets/html-manager/dist/..."), which RequireJS resolves against the page's own
//    folder. Point that module path at _static/widgets, where the book serves the fonts.
// 2. The manager typesets widget descriptions with MathJax 2's MathJax.Hub.Queue; the book runs
//    MathJax 3, which has no Hub (and replaces window.MathJax when its deferred script runs).
//    Once the page is parsed, before the widgets render, give MathJax 3 that one entry point.
require.config({
  paths: {
    "@jupyter-widgets/html-manager/dist":
      (document.documentElement.dataset.content_root || "") + "_static/widgets",
  },
});
document.addEventListener("DOMContentLoaded", function () {
  if (window.MathJax && !window.MathJax.Hub) {
    window.MathJax.Hub = {
      Queue: function (command) {
        if (window.MathJax.typesetPromise) window.MathJax.typesetPromise([command[2]]);
      },
    };
  }
});
