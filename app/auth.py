"""Who may read the dashboard: an access token, or Streamlit's own sign-in against an OIDC provider.

``trustscope dashboard`` decides the mode (:func:`plan`) and hands it to the Streamlit process through its
environment, never its command line: :data:`TOKEN_ENV` holds the token, :data:`MODE_ENV` says ``oidc`` where the
provider configured in ``.streamlit/secrets.toml`` (``[auth]``) signs people in. The router calls :func:`gate`
before it builds the menu or reads a single log: a session that has not shown the token (in ``?token=``, the
sign-in form, or the session cookie a sign-in leaves) sees only the sign-in form.

The token is compared in constant time, remembered for the session, removed from the address bar once accepted,
and never written to a log or to the page. The cookie that keeps a reload signed in holds an HMAC of the token,
not the token.

Everything above :func:`gate` is free of Streamlit imports: the command line uses it to start fast.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "TRUSTSCOPE_DASHBOARD_TOKEN"
"""The access token; when set (by ``--token``, by the user, or generated), every page asks for it."""
MODE_ENV = "TRUSTSCOPE_DASHBOARD_AUTH"
"""``oidc``: the pages are for whoever the ``[auth]`` provider of ``.streamlit/secrets.toml`` signed in."""
TOKEN_PARAM = "token"
"""The query parameter a link carries the token in (``http://host:port/?token=...``), as Jupyter's do."""
COOKIE_MAX_AGE_S = 7 * 24 * 3600
"""How long a browser stays signed in after it showed the token."""
MIN_TOKEN_CHARS = 16
_SESSION_KEY = "_trustscope_signed_in"
_COOKIE_PURPOSE = b"trustscope dashboard session"
_WILDCARD = {"", "0.0.0.0", "::", "[::]"}


class AuthError(ValueError):
    """The dashboard cannot start this way (exposed with no way to sign in, or a sign-in that cannot work)."""


@dataclass(frozen=True)
class Plan:
    """How one ``trustscope dashboard`` serves: the environment the Streamlit process gets and what to tell the
    person who started it."""

    mode: str
    """``token``, ``oidc`` or ``none``."""
    env: dict[str, str | None]
    """Variables to set in the Streamlit process (``None``: removed)."""
    generated: bool = False
    """Whether the token was made here (then the URL printed to the terminal carries it)."""
    warnings: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, a name that resolves to those)."""
    name = host.strip("[]")
    if name in _WILDCARD:
        return False
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if name.lower() == "localhost":
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def oidc_configured(cwd: Path | None = None) -> bool:
    """Whether Streamlit's secrets (``~/.streamlit/secrets.toml``, then ``./.streamlit/secrets.toml``) configure
    an ``[auth]`` provider for ``st.login``."""
    auth: dict = {}
    for path in (Path.home() / ".streamlit" / "secrets.toml", (cwd or Path.cwd()) / ".streamlit" / "secrets.toml"):
        try:
            section = tomllib.loads(path.read_text()).get("auth")
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if isinstance(section, dict):
            auth.update(section)
    return bool(auth.get("redirect_uri") and auth.get("cookie_secret"))


def plan(host: str, token: str | None = None, no_auth: bool = False, interactive: bool = False,
         environ: dict[str, str] | None = None, cwd: Path | None = None) -> Plan:
    """Decide how a dashboard on ``host`` signs people in.

    A token given (``token``, else ``$TRUSTSCOPE_DASHBOARD_TOKEN``) is always required, on any address. Without
    one, loopback serves as before; any other address needs the OIDC provider of ``.streamlit/secrets.toml``, or,
    started from a terminal (``interactive``), a token generated here and printed with the URL. Anything else is
    refused unless ``no_auth`` (which also drops a token given) says to serve without a sign-in.
    """
    environ = os.environ if environ is None else environ
    exposed = not is_loopback(host)
    if no_auth:
        warning = (f"trustscope dashboard: WARNING: serving on {host} with no sign-in (--no-auth): anyone who can "
                   "reach the port reads every run and queries it in the SQL console") if exposed else None
        return Plan("none", {TOKEN_ENV: None, MODE_ENV: None}, warnings=(warning,) if warning else ())
    given = token if token is not None else environ.get(TOKEN_ENV)
    if given is not None:
        given = given.strip()
        if not given:
            raise AuthError(f"the access token is empty; give one with --token or {TOKEN_ENV}, or leave both unset")
        short = (f"trustscope dashboard: WARNING: the access token is {len(given)} characters long; one of at "
                 f"least {MIN_TOKEN_CHARS} (python -c 'import secrets; print(secrets.token_urlsafe())') is "
                 "hard to guess") if len(given) < MIN_TOKEN_CHARS else None
        return Plan("token", {TOKEN_ENV: given, MODE_ENV: None}, warnings=(short,) if short else ())
    if not exposed:
        return Plan("none", {MODE_ENV: None})
    if oidc_configured(cwd):
        import importlib.util

        if importlib.util.find_spec("authlib") is None:
            raise AuthError("the [auth] provider of .streamlit/secrets.toml signs in through Authlib, which is not "
                            "installed: pip install 'Authlib>=1.3.2' (or give --token)")
        return Plan("oidc", {MODE_ENV: "oidc", TOKEN_ENV: None})
    if interactive:
        return Plan("token", {TOKEN_ENV: secrets.token_urlsafe(32), MODE_ENV: None}, generated=True)
    raise AuthError(
        f"refusing to serve every run on {host} with no sign-in. Give an access token with --token or "
        f"{TOKEN_ENV} (a token is generated and printed when started from a terminal), configure an OIDC "
        "provider under [auth] in .streamlit/secrets.toml, or pass --no-auth to serve it open to anyone who can "
        "reach the port")


def display_host(host: str) -> str:
    """The name to print in the dashboard's URL: this machine's name for a wildcard address."""
    if host.strip("[]") in _WILDCARD:
        return socket.gethostname() or "localhost"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def cookie_name(port: int | str) -> str:
    """One cookie per port: two dashboards on one machine keep apart."""
    return f"trustscope_session_{port}"


def cookie_value(token: str) -> str:
    """What the session cookie holds: an HMAC of the token (it signs a browser in, but does not give the token)."""
    return hmac.new(token.encode(), _COOKIE_PURPOSE, hashlib.sha256).hexdigest()


def token_matches(given: object, token: str) -> bool:
    """Whether ``given`` is the token, compared in constant time."""
    return isinstance(given, str) and hmac.compare_digest(given.strip().encode(), token.encode())


# ---------------------------------------------------------------------------------------------------------------
# in the Streamlit process


def gate() -> None:
    """Return when this session may read the dashboard; otherwise show only the sign-in and stop the run.

    Runs before the router builds its menu or reads anything. The sign-in is served under every page's address, so
    a link to a page (with or without ``?token=``) opens that page once signed in.
    """
    import streamlit as st

    if os.environ.get(MODE_ENV) == "oidc":
        if not st.user.is_logged_in:
            _locked(_oidc_sign_in)
        return
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        return
    if TOKEN_PARAM in st.query_params:
        shown = st.query_params[TOKEN_PARAM]
        del st.query_params[TOKEN_PARAM]  # out of the address bar (and the browser's history), right or wrong
        if token_matches(shown, token):
            _sign_in()
        else:
            st.session_state["_trustscope_refused"] = True
    if st.session_state.get(_SESSION_KEY):
        if st.session_state.pop("_trustscope_set_cookie", False):
            _set_cookie(token)
        return
    cookie = st.context.cookies.get(cookie_name(_port()))
    if isinstance(cookie, str) and hmac.compare_digest(cookie.encode(), cookie_value(token).encode()):
        st.session_state[_SESSION_KEY] = True
        return
    _locked(_token_sign_in)


def _port() -> int:
    import streamlit as st

    return int(st.get_option("server.port"))


def _sign_in() -> None:
    """Remember the session; the run that goes on to the page leaves the cookie (:func:`_set_cookie`)."""
    import streamlit as st

    st.session_state[_SESSION_KEY] = True
    st.session_state["_trustscope_set_cookie"] = True
    st.session_state.pop("_trustscope_refused", None)


def _set_cookie(token: str) -> None:
    """Leave the session cookie, so that a reload of this browser stays signed in."""
    import streamlit as st

    secure = "(location.protocol === 'https:' ? '; Secure' : '')"
    st.html(f"<script>document.cookie = '{cookie_name(_port())}={cookie_value(token)}; Path=/; "
            f"Max-Age={COOKIE_MAX_AGE_S}; SameSite=Strict' + {secure};</script>", unsafe_allow_javascript=True)


def _locked(sign_in) -> None:
    """Serve ``sign_in`` under every page's address, with no menu, and stop the run there."""
    import streamlit as st

    from app.pages import PAGES

    entries = [st.Page(sign_in, title="Sign in", icon=":material/lock:",
                       url_path=page.url_path or "sign_in", default=page.default) for page in PAGES]
    st.navigation(entries, position="hidden").run()
    st.stop()


def _token_sign_in() -> None:
    import streamlit as st

    token = os.environ.get(TOKEN_ENV, "").strip()
    st.title("Sign in")
    if st.session_state.pop("_trustscope_refused", False):
        st.error("That access token is not the one this dashboard was started with.", icon=":material/key_off:")
    with st.form("trustscope_sign_in", clear_on_submit=True, enter_to_submit=True, width=480):
        st.caption("This dashboard asks for the access token it was started with: the `?token=` of the URL "
                   "`trustscope dashboard` printed, or the value of `--token` / `TRUSTSCOPE_DASHBOARD_TOKEN`.")
        shown = st.text_input("Access token", type="password", key="trustscope_token_input")
        if st.form_submit_button("Sign in", type="primary"):
            if token_matches(shown, token):
                _sign_in()
                st.rerun()
            st.error("That access token is not the one this dashboard was started with.", icon=":material/key_off:")


def _oidc_sign_in() -> None:
    import streamlit as st

    st.title("Sign in")
    st.caption("This dashboard is for the people its sign-in provider knows.")
    try:
        section = st.secrets.get("auth", {})
    except FileNotFoundError:  # no secrets file: Streamlit's own sign-in then says what to configure
        section = {}
    named = [name for name, value in section.items() if isinstance(value, Mapping)]
    providers = ([None] if "client_id" in section or not named else []) + named
    for provider in providers:
        label = "Sign in" if provider is None else f"Sign in with {provider}"
        st.button(label, type="primary", icon=":material/login:", on_click=st.login, args=(provider,),
                  key=f"trustscope_login_{provider}")
