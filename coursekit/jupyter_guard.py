"""JupyterLab that does only what its own pages ask: every request that changes something must
come from the server's origin (or the portal's, under Open OnDemand).

Jupyter checks a request's Origin, and its XSRF token, in its own API handlers. Two kinds of
handler escape that: jupyter-server-proxy's, which leave the check to the proxied app (MLflow's
UI, say), and, where XSRF checks are off, nbgrader's (/assignments/fetch, submit, validate, and
the formgrader's autograde). A page of another origin that the browser sends the session's cookie
with (a sibling subdomain of the portal, which SameSite counts as the same site) could then fetch,
submit or grade in the trainee's or the instructor's name. So this server extension refuses, for
every handler the server serves, a POST, PUT, PATCH or DELETE whose Origin header names another
origin; and PortalLoginHandler keeps XSRF checks on everywhere else by standing in for the one
form that cannot carry the token: OnDemand's Connect button, which posts the session's password
from the dashboard's page.

Enabled by `python -m coursekit lab` (launch.lab_command) and the OnDemand session
(ondemand/template/before.sh.erb)."""
from urllib.parse import urlparse

from jupyter_server.auth.login import LoginFormHandler
from tornado import web

CHANGING_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def origin_allowed(origin, host, allow_origin):
    """Whether a request from ``origin`` may change something on the server at ``host``: it is
    the server's own origin, or the one origin the server allows (the portal's)."""
    if origin is None:  # not a browser's cross-origin request: a script, with its token
        return True
    return urlparse(origin.lower()).netloc == host or origin.lower() == allow_origin.lower()


class RefusedHandler(web.RequestHandler):
    """What a request from another origin gets, whatever handler it was for."""

    def prepare(self):
        raise web.HTTPError(403, f"requests from {self.request.headers['Origin']} are refused")


class PortalLoginHandler(LoginFormHandler):
    """Jupyter's login form, taking the password without an XSRF token when it is posted from
    the server's or the portal's origin (the Connect button's page cannot hold the token)."""

    def check_xsrf_cookie(self):
        headers = self.request.headers
        if not origin_allowed(headers.get("Origin"), headers.get("Host"), self.allow_origin):
            raise web.HTTPError(403, "a login from another origin is refused")


def _jupyter_server_extension_points():
    return [{"module": "coursekit.jupyter_guard"}]


def _load_jupyter_server_extension(serverapp):
    """Route every changing request from another origin to RefusedHandler, before any handler,
    whoever registered it, sees it."""
    app, allow_origin = serverapp.web_app, serverapp.allow_origin
    find_handler = app.find_handler

    def guarded_find_handler(request, **kwargs):
        if request.method in CHANGING_METHODS and not origin_allowed(
                request.headers.get("Origin"), request.headers.get("Host"), allow_origin):
            return app.get_handler_delegate(request, RefusedHandler)
        return find_handler(request, **kwargs)

    app.find_handler = guarded_find_handler
