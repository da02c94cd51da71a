"""Render the chart without helm: the subset of Go templates and Sprig functions the chart uses, filled in as
helm fills them in (whitespace trimming, nesting, ``range``, ``define``/``include``, pipelines).

Actions: ``if``/``else``/``end`` (nested), ``range LIST`` (``.`` is the item, ``$`` the root), ``define "n"`` in
``_helpers.tpl`` with ``include "n" .``, and the functions ``quote``, ``toYaml``, ``nindent``, ``indent``, ``not``,
``default``, ``required`` (a missing value raises :class:`RenderError` with its message, as helm fails the
install). Anything else raises, so a template that outgrows this renderer fails its test instead of passing
untested.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "hetsched"
_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


@dataclass
class _Block:
    kind: str  # "root", "if", "range", "define"
    arg: str = ""
    body: list[Any] = field(default_factory=list)
    other: list[Any] = field(default_factory=list)
    in_else: bool = False

    def add(self, node: Any) -> None:
        (self.other if self.in_else else self.body).append(node)


def _parse(text: str) -> tuple[list[Any], dict[str, list[Any]]]:
    """The template as a tree of text, ``("expr", body)`` and blocks; and the ``define``d templates."""
    stack = [_Block("root")]
    defines: dict[str, list[Any]] = {}
    pos, trim_next = 0, False
    for match in _ACTION.finditer(text):
        chunk = text[pos:match.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if match.group(1):
            chunk = chunk.rstrip()
        if chunk:
            stack[-1].add(chunk)
        pos, trim_next = match.end(), bool(match.group(3))
        body = match.group(2)
        word, _, rest = body.partition(" ")
        if body.startswith("/*"):
            continue
        if word in ("if", "range", "define"):
            stack.append(_Block(word, rest.strip()))
        elif word == "else":
            stack[-1].in_else = True
        elif word == "end":
            block = stack.pop()
            if block.kind == "define":
                defines[shlex.split(block.arg)[0]] = block.body
            else:
                stack[-1].add(block)
        else:
            stack[-1].add(("expr", body))
    tail = text[pos:]
    stack[-1].add(tail.lstrip() if trim_next else tail)
    assert len(stack) == 1, f"unclosed {stack[-1].kind} {stack[-1].arg}"
    return stack[0].body, defines


def _go_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).removesuffix("\n").removesuffix("\n...")


class RenderError(Exception):
    """What stops ``helm install``: a ``required`` value is missing (the message is the template's)."""


class Chart:
    """The chart's templates, rendered against ``values`` (``Release.Namespace`` is ``namespace``)."""

    def __init__(self, values: dict[str, Any], *, namespace: str = "hetsched", chart: Path = CHART) -> None:
        self.root = {"Values": values, "Release": {"Namespace": namespace, "Name": "hetsched"}}
        self.chart = chart
        self.defines: dict[str, list[Any]] = {}
        for helper in sorted((chart / "templates").glob("_*.tpl")):
            self.defines.update(_parse(helper.read_text())[1])

    def text(self, template: str) -> str:
        nodes, _ = _parse((self.chart / "templates" / template).read_text())
        return self._render(nodes, self.root)

    def documents(self, template: str) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.text(template)) if d]

    def all_documents(self) -> list[dict[str, Any]]:
        return [d for t in sorted(p.name for p in (self.chart / "templates").glob("*.yaml")) for d in self.documents(t)]

    def _render(self, nodes: list[Any], dot: Any) -> str:
        out: list[str] = []
        for node in nodes:
            if isinstance(node, str):
                out.append(node)
            elif isinstance(node, tuple):
                out.append(_go_text(self._pipeline(node[1], dot)))
            elif node.kind == "if":
                out.append(self._render(node.body if self._truthy(self._pipeline(node.arg, dot)) else node.other, dot))
            elif node.kind == "range":
                items = self._pipeline(node.arg, dot) or []
                out.extend(self._render(node.body, item) for item in items)
        return "".join(out)

    @staticmethod
    def _truthy(value: Any) -> bool:
        return bool(value) and value != 0

    def _pipeline(self, body: str, dot: Any) -> Any:
        value: Any = None
        for i, command in enumerate(part.strip() for part in body.split("|")):
            words = shlex.split(command)
            args = [self._operand(w, dot) for w in words[1:]] + ([value] if i else [])
            value = self._call(words[0], args, dot) if not words[0].startswith(("$", ".", '"')) or len(words) > 1 \
                else self._operand(words[0], dot)
        return value

    def _operand(self, word: str, dot: Any) -> Any:
        if word.isdigit():
            return int(word)
        if word == ".":
            return dot
        if word.startswith(("$.", ".")):
            node: Any = self.root if word.startswith("$") else dot
            for part in word.removeprefix("$").strip(".").split("."):
                node = node.get(part) if isinstance(node, dict) else None
            return node
        if word == "$":
            return self.root
        return word  # a string literal (shlex removed its quotes)

    def _call(self, name: str, args: list[Any], dot: Any) -> Any:
        if name == "quote":
            return json.dumps(_go_text(args[0]))
        if name == "toYaml":
            return _to_yaml(args[0])
        if name in ("nindent", "indent"):
            text = "\n".join(" " * args[0] + line for line in str(args[1]).split("\n"))
            return "\n" + text if name == "nindent" else text
        if name == "not":
            return not self._truthy(args[0])
        if name == "default":
            return args[1] if self._truthy(args[1]) else args[0]
        if name == "required":
            if not self._truthy(args[1]):
                raise RenderError(args[0])
            return args[1]
        if name == "include":
            return self._render(self.defines[args[0]], args[1])
        raise NotImplementedError(f"template function {name!r}: extend tests/chart_support.py")
