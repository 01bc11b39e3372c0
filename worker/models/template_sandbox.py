"""Chat templates rendered as untrusted code: sandboxed, and bounded in steps, size, memory and time.

A chat template comes with the model file, and a model file is untrusted input. jinja2's
``ImmutableSandboxedEnvironment`` (what transformers uses) keeps a template from reaching Python's
internals but not from looping forever (nested ``range`` loops, recursive macros) or from building
a string of gigabytes (``{{ 'x' * 1000000000 }}``). Jinja holds the GIL while it runs, so a
watchdog thread cannot stop it; this environment stops it from inside instead:

- every step (a call, an attribute or item lookup, an intercepted operator, a filter, an output
  piece, each iteration of a ``for`` loop) is counted, and the render stops past ``max_steps`` or
  ``max_seconds``;
- every value an operation would build is sized *before* it is built (``*``, ``+``, ``%``, ``**``,
  ``str.format``, width-taking and joining filters and methods, ``~``, output of containers), and
  refused past ``max_chars``; what is built is charged to ``max_alloc_bytes`` (so recursion holding
  many large values is stopped too);
- the output, and every macro's or ``{% set %}`` block's text, is at most ``max_chars``.

A stopped render raises :class:`TemplateLimitError` (a jinja2 TemplateError); the tokenizer reports
it as ChatTemplateError: a 400 for a request, a startup error for the probe at start
(:func:`check_chat_template`).
"""

from __future__ import annotations

import contextvars
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = [
    "DEFAULT_LIMITS",
    "ChatTemplateError",
    "TemplateLimitError",
    "TemplateLimits",
    "check_chat_template",
    "compile_chat_template",
]


class ChatTemplateError(ValueError):
    """The chat template is missing or could not render the given messages."""


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A render stopped at one of its limits (TemplateLimits)."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may cost."""

    #: The output, and any one value the template builds (characters). A request body is at most
    #: 4 MiB, so any prompt a request can carry renders well within 8 Mi characters.
    max_chars: int = 8 << 20
    #: Memory all values built during one render may take together (bytes, as sys.getsizeof counts).
    #: Real templates build a few times their output; this leaves 32 MiB-output renders room.
    max_alloc_bytes: int = 256 << 20
    #: Steps (calls, lookups, operators, filters, loop iterations, output pieces) of one render; a
    #: real template takes tens per message.
    max_steps: int = 4_000_000
    #: Wall-clock seconds of one render (real ones take milliseconds).
    max_seconds: float = 2.0
    #: Source length of a template (characters); real ones are at most tens of KB.
    max_source_chars: int = 1 << 20


DEFAULT_LIMITS = TemplateLimits()
#: Integers a template may compute with (bits): real templates count messages.
_MAX_INT_BITS = 4096


class _Budget:
    """One render's counters (a ContextVar holds the current one: renders run on several threads)."""

    __slots__ = ("alloc", "deadline", "limits", "steps")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.alloc = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise TemplateLimitError(f"the template ran more than {self.limits.max_steps} steps")
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran longer than {self.limits.max_seconds} s")

    def charge(self, value: Any) -> None:
        """Count what building ``value`` took (strings, bytes and containers; small values are free)."""
        if isinstance(value, (str, bytes, list, tuple, dict, set)):
            size = len(value)
            if size > self.limits.max_chars:
                raise TemplateLimitError(f"the template built a value of {size} items; at most {self.limits.max_chars}")
            self.alloc += sys.getsizeof(value)
            if self.alloc > self.limits.max_alloc_bytes:
                raise TemplateLimitError(f"the template built more than {self.limits.max_alloc_bytes} bytes of values")

    def fits(self, size: int, what: str) -> None:
        """Refuse, before it is built, a value of ``size`` characters or items."""
        if size > self.limits.max_chars:
            raise TemplateLimitError(f"{what} would build {size} characters; at most {self.limits.max_chars}")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("muxworker_template_budget", default=None)


def _budget() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()
    return budget


def _text_size(value: Any, limit: int) -> int:
    """About how many characters ``str(value)`` (or json.dumps) makes, counted only up to ``limit``
    (so a list holding the same long string 10^5 times costs ``limit`` steps, not 10^12)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + 2
        elif isinstance(item, dict):
            total += 2 * len(item) + 2
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 * len(item) + 2
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 1
        else:
            total += 8
    return total


def _check_text(budget: _Budget | None, value: Any, what: str) -> None:
    if budget is not None and not isinstance(value, str):
        budget.fits(_text_size(value, budget.limits.max_chars), what)


def _ints(args: Iterable[Any]) -> Iterator[int]:
    return (a for a in args if isinstance(a, int) and not isinstance(a, bool))


def _check_widths(budget: _Budget, what: str, args: Iterable[Any]) -> None:
    """Width, fill and count arguments (center(10**9), ljust, zfill, indent, slice) bound the output."""
    for n in _ints(args):
        budget.fits(abs(n), what)


_NUMBERS = re.compile(r"\d+")


def _check_format(budget: _Budget, template: str, args: Iterable[Any], what: str) -> None:
    """``'%1000000000s' % x`` and ``'{:>1000000000}'.format(x)``: widths and precisions in the
    format string (and given as arguments) add up to at most what the output can hold."""
    budget.fits(len(template) + sum(int(n) for n in _NUMBERS.findall(template) if len(n) < 12), what)
    for n in _NUMBERS.findall(template):
        if len(n) >= 12:
            budget.fits(10 ** (len(n) - 1), what)
    items = list(args)
    _check_widths(budget, what, items)
    budget.fits(sum(_text_size(a, budget.limits.max_chars) for a in items), what)


def _check_replace(budget: _Budget, s: Any, old: Any, new: Any, what: str) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if not old else s.count(old)
        budget.fits(len(s) + count * max(0, len(new) - len(old)), what)


def _check_join(budget: _Budget, sep: Any, items: Any, what: str) -> list[Any]:
    """Join's output: the items' text plus the separator between each; returns the items as a list."""
    values = list(items)
    budget.fits(len(values), what)
    sep_len = len(sep) if isinstance(sep, str) else 0
    budget.fits(_text_size(values, budget.limits.max_chars) + sep_len * max(0, len(values) - 1), what)
    return values


def _check_str_method(budget: _Budget, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Checks for the str methods whose output can outgrow their input."""
    s, name = method.__self__, method.__name__
    what = f"str.{name}"
    if name in ("center", "ljust", "rjust", "zfill"):
        _check_widths(budget, what, args)
    elif name == "expandtabs":
        width = next(_ints([*args, *kwargs.values()]), 8)
        budget.fits(len(s) + s.count("\t") * abs(width), what)
    elif name == "replace" and len(args) >= 2:
        _check_replace(budget, s, args[0], args[1], what)
    elif name == "join" and args:
        _check_join(budget, s, args[0], what)
    elif name in ("format", "format_map"):
        _check_format(budget, s, [*args, *kwargs.values()], what)


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a jinja2 filter) checked and charged like a call."""

    # A filter marked pass_environment/pass_context/pass_eval_context gets that first, then the value.
    value_at = 1 if hasattr(func, "jinja_pass_arg") else 0

    def check(args: tuple[Any, ...], kwargs: dict[str, Any], budget: _Budget) -> tuple[Any, ...]:
        if len(args) <= value_at:
            return args
        value, rest = args[value_at], (*args[value_at + 1 :], *kwargs.values())
        what = f"the {name} filter"
        if name == "center":
            _check_widths(budget, what, rest)
        elif name == "slice":  # slice(n) makes n lists, empty ones past the value's length
            n = next(_ints(rest[:1]), 0)
            if n > (len(value) if isinstance(value, (str, list, tuple, dict)) else 0) + 1:
                raise TemplateLimitError(f"the slice filter would make {n} slices of a shorter value")
        elif name == "indent":
            width = args[value_at + 1] if len(args) > value_at + 1 else kwargs.get("width", 4)
            indent = len(width) if isinstance(width, str) else abs(width) if isinstance(width, int) else 4
            text = value if isinstance(value, str) else ""
            budget.fits(len(text) + (text.count("\n") + 1) * indent, what)
        elif name == "replace" and len(rest) >= 2:
            _check_replace(budget, value, rest[0], rest[1], what)
        elif name == "join":
            sep = rest[0] if rest else ""
            values = _check_join(budget, sep, value if not isinstance(value, str) else [value], what)
            if not isinstance(value, (str, list, tuple)):
                args = (*args[:value_at], values, *args[value_at + 1 :])
        elif name == "format" and isinstance(value, str):
            _check_format(budget, value, rest, what)
        elif name == "sum":  # a sum of lists is quadratic in one C call: a number to start from refuses them
            start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
            if isinstance(start, bool) or not isinstance(start, (int, float)):
                raise TemplateLimitError("the sum filter adds numbers only here (start must be a number)")
        elif name in ("string", "tojson", "pprint", "e", "escape", "forceescape", "urlize", "xmlattr", "urlencode"):
            _check_text(budget, value, what)
        return args

    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            # Outside a render: jinja folding a filter of constants at compile time ('x'|center(10**9)
            # would be built unchecked). Impossible makes it compile the call for the render instead.
            raise nodes.Impossible()
        args = check(args, kwargs, budget)
        result = func(*args, **kwargs)
        budget.charge(result)
        return result

    # jinja passes the environment or context to filters marked for it: keep the mark.
    for attr in ("jinja_pass_arg",):
        if hasattr(func, attr):
            setattr(guarded, attr, getattr(func, attr))
    guarded.__name__ = getattr(func, "__name__", name)
    return guarded


class _Counted:
    """The iterable of a ``for`` loop, one step per item. Keeps len() for ``loop.length``."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[Any]:
        for item in self._inner:
            _budget()
            yield item


def _count_iterations(iterable: Any) -> Any:
    if isinstance(iterable, jinja2.Undefined):
        return iterable
    try:
        len(iterable)
    except TypeError:
        return _counted_generator(iterable)
    return _Counted(iterable)


def _counted_generator(iterable: Any) -> Iterator[Any]:
    for item in iterable:
        _budget()
        yield item


def _concat_values(*values: Any) -> str:
    """``a ~ b``: sized before it is joined."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.fits(sum(_text_size(v, budget.limits.max_chars) for v in values), "the ~ operator")
    text = "".join(str(v) for v in values)
    if budget is not None:
        budget.charge(text)
    return text


def _concat(pieces: Iterable[str]) -> str:
    """Every macro body, {% set %} block and filter block is joined here: sized first."""
    parts = pieces if isinstance(pieces, list) else list(pieces)
    budget = _BUDGET.get()
    if budget is not None:
        budget.fits(sum(len(p) for p in parts), "a macro or block")
    text = "".join(parts)
    if budget is not None:
        budget.charge(text)
    return text


def _finalize(value: Any) -> Any:
    """Every ``{{ }}``: a container's text is sized before str() makes it."""
    budget = _budget()
    _check_text(budget, value, "the output of a value")
    return value


class _Bounding(NodeTransformer):
    """Every for loop iterates through a counter, every ``~`` joins through a sized join: Jinja
    compiles both to plain Python that no sandbox hook sees."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)  # in place: a For's children are replaced, the For stays
        node.iter = nodes.Call(nodes.EnvironmentAttribute("mux_iter"), [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("mux_concat"), node.nodes, [], None, None, lineno=node.lineno)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every step counted and every value sized (module docstring)."""

    intercepted_binops = frozenset({"*", "+", "%", "**", "//"})
    concat = staticmethod(_concat)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(finalize=_finalize, **kwargs)
        self.globals.pop("lipsum", None)  # lipsum(10**9) builds gigabytes in one call; no template uses it
        self.filters = {name: _guarded_filter(name, f) for name, f in self.filters.items()}
        self.mux_iter = _count_iterations
        self.mux_concat = _concat_values

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Bounding().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        if __obj is _count_iterations or __obj is _concat_values:
            return __obj(*args)  # jinja adds _loop_vars/_block_vars to calls in loops and blocks
        # The sandbox hands str.format out wrapped (functools.update_wrapper keeps __wrapped__).
        method = getattr(__obj, "__wrapped__", __obj)
        if budget is not None and isinstance(getattr(method, "__self__", None), str):
            _check_str_method(budget, method, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if budget is not None:
            budget.charge(result)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is not None:
            _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if budget is not None:
            budget.charge(result)
        return result


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    what = f"the {operator} operator"
    ints = [v for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
    if operator == "*":
        seq = next((v for v in (left, right) if isinstance(v, (str, bytes, list, tuple))), None)
        if seq is not None and len(ints) == 1:
            budget.fits(len(seq) * max(0, ints[0]), what)
        elif len(ints) == 2 and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would make an integer of more than {_MAX_INT_BITS} bits")
    elif operator == "**" and len(ints) == 2:
        if right > 0 and abs(left) > 1 and right * left.bit_length() > _MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would make an integer of more than {_MAX_INT_BITS} bits")
    elif operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_INT_BITS:
        raise TemplateLimitError(f"{what}: an exponent of {right} is out of range")
    elif operator == "+":
        sizes = [len(v) for v in (left, right) if isinstance(v, (str, bytes, list, tuple))]
        if len(sizes) == 2:
            budget.fits(sum(sizes), what)
    elif operator == "%" and isinstance(left, str):
        _check_format(budget, left, right if isinstance(right, tuple) else [right], what)


class _BoundedTemplate(jinja2.Template):
    """A template whose every render runs under its environment's limits."""

    limits: TemplateLimits = DEFAULT_LIMITS

    def render(self, *args: Any, **kwargs: Any) -> str:
        budget = _Budget(self.limits)
        token = _BUDGET.set(budget)
        try:
            out: list[str] = []
            size = 0
            for piece in self.generate(*args, **kwargs):
                size += len(piece)
                if size > self.limits.max_chars:
                    raise TemplateLimitError(f"the template's output passed {self.limits.max_chars} characters")
                budget.step()
                out.append(piece)
            return "".join(out)
        except RecursionError:
            raise TemplateLimitError("the template recursed too deeply") from None
        except MemoryError:
            raise TemplateLimitError("the template ran out of memory") from None
        except OverflowError as e:
            raise TemplateLimitError(f"the template computed a number out of range: {e}") from None
        finally:
            _BUDGET.reset(token)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' training
    masks. Rendering a prompt only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    if isinstance(indent, int) and not isinstance(indent, bool):
        budget = _BUDGET.get()
        if budget is not None:  # indentation repeats per nesting level and line
            budget.fits(_text_size(x, budget.limits.max_chars) * (abs(indent) + 1), "the tojson filter")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str, limits: TemplateLimits = DEFAULT_LIMITS) -> jinja2.Template:
    """The template in the environment transformers uses (sandboxed and immutable,
    trim_blocks/lstrip_blocks, loop controls, and its raise_exception/tojson/strftime_now), every
    render bounded by ``limits``."""
    if len(source) > limits.max_source_chars:
        raise ChatTemplateError(
            f"the model's chat template has {len(source)} characters; at most {limits.max_source_chars}"
        )
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _guarded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    template_class = type("BoundedTemplate", (_BoundedTemplate,), {"limits": limits})
    env.template_class = template_class
    try:
        return env.from_string(source)
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e


#: The conversation the template is tried on at start: one every chat template must take.
_PROBE = [{"role": "user", "content": "Hello"}]


def check_chat_template(source: str, limits: TemplateLimits = DEFAULT_LIMITS, **variables: Any) -> jinja2.Template:
    """Compile ``source`` and render it once on a one-message conversation, under ``limits``: a
    template that does not compile, or loops or grows past its limits on the simplest chat, is
    refused at start (ChatTemplateError). One that rejects the probe with raise_exception (some want
    a system message first) is not refused for that: requests get the template's own error."""
    template = compile_chat_template(source, limits)
    try:
        template.render(messages=_PROBE, add_generation_prompt=True, tools=None, documents=None, **variables)
    except TemplateLimitError as e:
        raise ChatTemplateError(f"the model's chat template was stopped rendering one message: {e}") from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError):
        pass
    return template
