"""What the sandbox shows the notebook's page: only output that cannot run code there.

Everything a cell displays reaches the user's browser, where JupyterLab renders it inside the
page that holds the user's Jupyter session: a script there can read and write the user's
files and open a terminal through the server's REST API. So, unless the user trusts this
notebook's output (`%sandbox trust-output on`), every mime bundle and widget model from the
sandbox passes through OutputFilter:

- mime bundles keep only types whose renderers run no code (SAFE_MIME_TYPES), HTML through
  safe_html, markdown and LaTeX only where their renderers cannot be made to emit a link to a
  script (otherwise they are shown as their text); what is withheld is said in one line of
  text/plain when no rich representation is left;
- comm messages: ipywidgets models of the core widget libraries, with the fields those
  widgets render as HTML made safe (HTML and HTMLMath values, HTML descriptions, an Output
  widget's outputs), and the state replies that restore them; models of other widget
  libraries are withheld: the page's widget manager loads whatever library a model names,
  and that library may run what the sandbox sends (anywidget runs a model's `_esm` source).
  Comms to other targets pass: a target exists only where frontend code the user installed
  registered it, and that code decides what it accepts;
- comms the kernel opened itself (its progress bars, progress_widget.py) are host state: no
  message of the sandbox's reaches them, whatever its trust.
"""

from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass
from typing import Any

from sandbox_kernel.kernel.safe_html import risky_tex, safe_html

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Renderers that run no code of the output's: text, images (SVG too: JupyterLab 4 shows it as
# an <img> of a data URL, where scripts do not run), JSON (a tree viewer), PDF (the browser's
# viewer), ipywidgets' views (by model id: models are filtered on their own comm), and the
# types made safe here.
SAFE_MIME_TYPES = frozenset({
    "text/plain", "text/html", "text/markdown", "text/latex",
    "image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp", "image/svg+xml",
    "application/json", "application/pdf", WIDGET_VIEW,
})
RICH = SAFE_MIME_TYPES - {"text/plain"}
# Markdown is rendered to HTML and put into the page as trusted: raw HTML in it runs, and so
# does a link whose URL decodes (entities, escapes) to javascript:, or an image that is fetched
# from the user's machine. Markdown with any of these is shown as its text.
MARKDOWN_RISKS = re.compile(r"<|&(#\d+|#x[0-9a-f]+|[a-z][a-z0-9]*);|!\[[^\]]*\]\s*[(\[]", re.I)
SCRIPT_SCHEME = re.compile(r"(javascript|vbscript|livescript):", re.I)
URL_NOISE = re.compile(r"[\x00-\x20\x7f\\]")

WIDGET_TARGET = "jupyter.widget"
WIDGET_CONTROL_TARGET = "jupyter.widget.control"  # the frontend asks it for every model's state
CORE_WIDGET_MODULES = frozenset({"@jupyter-widgets/base", "@jupyter-widgets/controls",
                                 "@jupyter-widgets/output"})
HTML_VALUE_VIEWS = frozenset({"HTMLView", "HTMLMathView"})
OUTPUT_VIEW = "OutputView"
# What a widget is: set when it opens, never changed by an update (or an innocent Text model
# could become an HTML view of the value it already has).
IDENTITY = ("_model_module", "_model_module_version", "_model_name",
            "_view_module", "_view_module_version", "_view_name")
TRUST_HINT = "%sandbox trust-output on shows it"
# Comms the filter remembers at most: the sandbox opens them, and the kernel's memory must not
# grow with what it sends. Past this, new comms are withheld (no notebook shows this many).
MAX_COMMS = 100_000


@dataclass
class _Widget:
    """What the filter knows of one widget model the frontend has."""
    view_name: str
    description: str = ""
    description_allow_html: bool = False


class OutputFilter:
    """One kernel's filter of the sandbox's output (trusted: everything passes unchanged)."""

    def __init__(self) -> None:
        self.trusted = False
        self.widgets: dict[str, _Widget] = {}  # comm id: a core widget model the frontend has
        self.withheld: set[str] = set()  # comm ids of models and comms kept from the frontend
        self.other_comms: set[str] = set()  # other comms the frontend has (e.g. its control comm)
        # Comms the kernel opened itself, for its life (a closed one's id is never the sandbox's
        # to take: the page may still send on it). comms.py keeps the frontend's messages on
        # them from the sandbox.
        self.host_comms: set[str] = set()
        # A frontend opened ipywidgets' control comm: it has a widget manager (JupyterLab's
        # asks for every model's state when it meets the kernel), so it can show the kernel's
        # progress as a widget.
        self.frontend_has_widgets = False

    # -- mime bundles: display_data, execute_result, pages, inspection --------------------

    def bundle(self, data: Any, metadata: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A mime bundle and its metadata as the page may render them."""
        data = data if isinstance(data, dict) else {}
        metadata = metadata if isinstance(metadata, dict) else {}
        if self.trusted:
            return data, metadata
        kept: dict[str, Any] = {}
        withheld: list[str] = []
        for mime, value in data.items():
            safe = self._safe_value(str(mime), value)
            if safe is None:
                withheld.append(str(mime))
            else:
                kept[mime] = safe
        if withheld and not RICH.intersection(kept):
            kept["text/plain"] = self._stand_in(data, kept, withheld)
        return kept, {key: value for key, value in metadata.items() if key not in withheld}

    def _safe_value(self, mime: str, value: Any) -> Any:
        """The value as the page may render it, or None if it is withheld."""
        if mime not in SAFE_MIME_TYPES:
            return None
        if mime == "application/json" or mime == WIDGET_VIEW:
            if mime == WIDGET_VIEW and (not isinstance(value, dict) or value.get("model_id") in self.withheld):
                return None
            return value
        if not isinstance(value, str):
            return None  # every other type is text (images are base64)
        if mime == "text/html":
            return safe_html(value)
        if mime == "text/markdown" and not safe_markdown(value):
            return None
        if mime == "text/latex" and risky_tex(value):
            return None
        return value

    @staticmethod
    def _stand_in(data: dict[str, Any], kept: dict[str, Any], withheld: list[str]) -> str:
        """text/plain for a bundle whose rich representations were all withheld: its own text
        (markdown's source rather than a repr) and one line saying what was held back."""
        text = data.get("text/markdown") if isinstance(data.get("text/markdown"), str) else kept.get("text/plain", "")
        reason = ("it could run code in this page, with your Jupyter rights" if withheld != ["text/markdown"]
                  else "it has raw HTML, entities, images or script links")
        note = f"[sandbox-kernel] {', '.join(withheld)} withheld: {reason} ({TRUST_HINT})"
        return f"{text}\n{note}" if text else note

    def page_payload(self, payload: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """An execute_reply's payloads: a pager page's bundle is filtered like any other."""
        filtered = []
        for item in payload:
            if item.get("source") == "page":
                item = {**item, "data": self.bundle(item.get("data"), {})[0]}
            filtered.append(item)
        return filtered

    def user_expressions(self, results: dict[str, Any]) -> dict[str, Any]:
        return {name: self._result(result) for name, result in results.items()}

    def _result(self, result: dict[str, Any]) -> dict[str, Any]:
        if "data" not in result:
            return result  # an error: text only
        data, metadata = self.bundle(result.get("data"), result.get("metadata"))
        return {**result, "data": data, "metadata": metadata}

    def debug_response(self, response: dict[str, Any]) -> dict[str, Any]:
        """The debugger's rich variable view renders a mime bundle of the sandbox's."""
        body = response.get("body")
        if response.get("command") != "richInspectVariables" or not isinstance(body, dict):
            return response
        return {**response, "body": self._result(body) if "data" in body else body}

    # -- comms ------------------------------------------------------------------------------

    def comm_from_frontend(self, msg_type: str, content: dict[str, Any]) -> None:
        """The frontend opened a comm (ipywidgets' control comm): the sandbox's answers on it
        may pass, filtered."""
        comm_id = content.get("comm_id")
        if msg_type == "comm_open" and isinstance(comm_id, str):
            self.other_comms.add(comm_id)
            self.frontend_has_widgets |= content.get("target_name") == WIDGET_CONTROL_TARGET

    def is_host_comm(self, comm_id: object) -> bool:
        return isinstance(comm_id, str) and comm_id in self.host_comms

    def new_host_comm(self) -> str:
        """An id for a comm of the kernel's own, none the sandbox or the frontend has used."""
        while (comm_id := uuid.uuid4().hex) in self.widgets or comm_id in self.withheld or \
                comm_id in self.other_comms or comm_id in self.host_comms:
            pass
        self.host_comms.add(comm_id)
        return comm_id

    def comm_from_sandbox(self, msg_type: str, content: dict[str, Any],
                          buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]] | None:
        """A comm message of the sandbox's as the page may have it, or None to withhold it."""
        comm_id = content.get("comm_id")
        if not isinstance(comm_id, str) or self.is_host_comm(comm_id):
            return None
        data = content.get("data") if isinstance(content.get("data"), dict) else {}
        if msg_type == "comm_open":
            if self._remembered() >= MAX_COMMS:
                return None
            return self._open(comm_id, content, data, buffers)
        if msg_type == "comm_close":
            withheld = comm_id in self.withheld
            self.withheld.discard(comm_id)
            self.widgets.pop(comm_id, None)
            self.other_comms.discard(comm_id)
            return None if withheld and not self.trusted else (content, buffers)
        if self.trusted:
            return content, buffers
        if comm_id in self.widgets:
            state, paths, buffers = self._widget_state(self.widgets[comm_id], data.get("state"),
                                                       data.get("buffer_paths"), buffers, opening=False)
            return {**content, "data": {**data, "state": state, "buffer_paths": paths}}, buffers
        if comm_id in self.other_comms:
            if data.get("method") == "update_states":
                data, buffers = self._states(data, buffers)
                return {**content, "data": data}, buffers
            return content, buffers
        return None  # withheld, or a comm the frontend never saw open

    def _remembered(self) -> int:
        return len(self.widgets) + len(self.withheld) + len(self.other_comms)

    def _open(self, comm_id: str, content: dict[str, Any], data: dict[str, Any],
              buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]] | None:
        target = content.get("target_name")
        state = data.get("state") if isinstance(data.get("state"), dict) else {}
        if target == WIDGET_TARGET and _core_widget(state):
            widget = self.widgets[comm_id] = _Widget(view_name=str(state.get("_view_name")))
            if self.trusted:
                return content, buffers
            state, paths, buffers = self._widget_state(widget, state, data.get("buffer_paths"), buffers,
                                                       opening=True)
            return {**content, "data": {**data, "state": state, "buffer_paths": paths}}, buffers
        if target != WIDGET_TARGET or self.trusted:
            self.other_comms.add(comm_id)
            return content, buffers
        self.withheld.add(comm_id)
        return None

    def _states(self, data: dict[str, Any], buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """ipywidgets' reply with every model's state (a page that reloads asks for it)."""
        states = data.get("states") if isinstance(data.get("states"), dict) else {}
        paths = _paths(data.get("buffer_paths"), buffers)
        kept: dict[str, Any] = {}
        for model_id, entry in states.items():
            state = entry.get("state") if isinstance(entry, dict) else None
            if not isinstance(state, dict) or not _core_widget(state) or self.is_host_comm(model_id) or (
                    model_id not in self.widgets and self._remembered() >= MAX_COMMS):
                if self._remembered() < MAX_COMMS:
                    self.withheld.add(model_id)
                continue
            widget = self.widgets.setdefault(model_id, _Widget(view_name=str(state.get("_view_name"))))
            inner = [(path[2:], buffer) for path, buffer in paths if path[:2] == [model_id, "state"]]
            state, inner_paths, inner_buffers = self._widget_state(
                widget, state, [path for path, _ in inner], [buffer for _, buffer in inner], opening=True)
            kept[model_id] = {**entry, "state": state}
            paths = [(path, buffer) for path, buffer in paths if path[:1] != [model_id]]
            paths += [([model_id, "state", *path], buffer) for path, buffer in zip(inner_paths, inner_buffers)]
        paths = [(path, buffer) for path, buffer in paths if path[:1] and path[0] in kept]
        return ({**data, "states": kept, "buffer_paths": [path for path, _ in paths]},
                [buffer for _, buffer in paths])

    def _widget_state(self, widget: _Widget, state: Any, buffer_paths: Any, buffers: list[bytes],
                      opening: bool) -> tuple[dict[str, Any], list[list[Any]], list[bytes]]:
        """A core widget's state (or update of it) with its HTML fields made safe."""
        state = copy.copy(state) if isinstance(state, dict) else {}
        dropped = set() if opening else {key for key in IDENTITY if key in state}
        for key in dropped:
            del state[key]
        if widget.view_name in HTML_VALUE_VIEWS and isinstance(state.get("value"), str):
            state["value"] = safe_html(state["value"])
            dropped.add("value")
        if isinstance(state.get("description"), str):
            widget.description = state["description"]
        if isinstance(state.get("description_allow_html"), bool):
            widget.description_allow_html = state["description_allow_html"]
        if widget.description_allow_html and ("description" in state or "description_allow_html" in state):
            state["description"] = safe_html(widget.description)  # the page renders it as HTML
            dropped.add("description")
        if widget.view_name == OUTPUT_VIEW and isinstance(state.get("outputs"), list):
            state["outputs"] = [self._output(output) for output in state["outputs"] if isinstance(output, dict)]
            dropped.add("outputs")
        # Binary fields keep their buffers; a buffer would overwrite a field dropped or made safe.
        kept = [(path, buffer) for path, buffer in _paths(buffer_paths, buffers)
                if path[:1] and path[0] not in dropped]
        return state, [path for path, _ in kept], [buffer for _, buffer in kept]

    def _output(self, output: dict[str, Any]) -> dict[str, Any]:
        """One output of an Output widget's `outputs` (nbformat's shape)."""
        if output.get("output_type") not in ("display_data", "execute_result"):
            return output
        data, metadata = self.bundle(output.get("data"), output.get("metadata"))
        return {**output, "data": data, "metadata": metadata}


def safe_markdown(text: str) -> bool:
    """Whether JupyterLab's markdown renderer would make only inert HTML of `text`."""
    return not (MARKDOWN_RISKS.search(text) or SCRIPT_SCHEME.search(URL_NOISE.sub("", text))
                or risky_tex(text))


def _core_widget(state: dict[str, Any]) -> bool:
    """A model of ipywidgets' own libraries, whose views we know (both its model and view)."""
    return (state.get("_model_module") in CORE_WIDGET_MODULES
            and state.get("_view_module") in CORE_WIDGET_MODULES | {None})


def _paths(buffer_paths: Any, buffers: list[bytes]) -> list[tuple[list[Any], bytes]]:
    """Each buffer with its path (a malformed list of paths keeps no buffer)."""
    if not isinstance(buffer_paths, list) or len(buffer_paths) != len(buffers) or \
            not all(isinstance(path, list) for path in buffer_paths):
        return []
    return list(zip(buffer_paths, buffers))
