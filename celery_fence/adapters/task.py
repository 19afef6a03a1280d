"""FencedTask: the body's side of a fenced task, an adapter between Celery and one
:class:`~celery_fence.pipeline.execution.Execution` per attempt.

``__call__`` (or a subclass's own ``__call__``, wrapped when its class is made, which then runs
as the body) reads what the execution needs from Celery's request (the key, whether this is the
message's first delivery, the stored request), lets the execution claim, register, run the body
and settle, and carries out the disposition it returns in Celery's terms (its base
:class:`~celery_fence.adapters.resend.FencedResending`: return, raise, re-send, give the message
back); its sends are its other base's (:class:`~celery_fence.adapters.sending.FencedSending`).
The exits Celery drives in the worker's main process (hard time limit, expired or revoked
message) are :class:`~celery_fence.adapters.worker.FencedRequest`'s.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from celery.app.task import _task_stack

from celery_fence.adapters import direct
from celery_fence.adapters.installation import install
from celery_fence.adapters.request import request_text
from celery_fence.adapters.resend import RETRIES_EXCEEDED, FencedResending
from celery_fence.adapters.sending import FencedSending, published_at
from celery_fence.adapters.worker import FENCED_REQUEST, celery_command
from celery_fence.announce import tracing
from celery_fence.announce.transitions import Announcer
from celery_fence.body.fence import Fence
from celery_fence.config import FenceConfig, Fenced
from celery_fence.errors import ConfigurationError, FenceEagerWarning, FenceError
from celery_fence.ops.recovery import KEY_HEADER
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.backends import Backends, backends, limits_for
from celery_fence.pipeline.execution import Execution
from celery_fence.schema import KEY_LENGTH, valid_key
from celery_fence.store import Store
from celery_fence.store.records import RUN_HEADER, TAKEOVER_HEADER

logger = logging.getLogger("celery_fence")

#: Seconds before a message is re-sent when the settings are invalid (fix them and restart).
CONFIG_ERROR_COUNTDOWN = 30.0

#: Marks a ``__call__`` that runs the fenced pipeline (:meth:`FencedTask.__init_subclass__`).
FENCED_ENTRY = "__fence_entry__"

#: Request flag: a subclass's ``__call__`` is the body (``super().__call__`` then runs ``run``
#: only).
IN_SUBCLASS_CALL = "fence_in_subclass_call"


def _fenced_entry(call: Callable[..., Any]) -> Callable[..., Any]:
    """A subclass's own ``__call__`` (Flask's app-context task, any wrapper), run as the body of
    a fenced attempt: claim, store row and fence around it, whatever it does inside."""

    @functools.wraps(call)
    def __call__(self: FencedTask, *args: Any, **kwargs: Any) -> Any:
        if self.request.get(IN_SUBCLASS_CALL):  # a subclass of a subclass calls super(): fenced
            return call(self, *args, **kwargs)
        return self._fenced_call(args, kwargs, call)

    setattr(__call__, FENCED_ENTRY, True)
    return __call__


class FencedTask(FencedResending, FencedSending, Fenced):
    """Base class for fenced tasks: ``@app.task(base=FencedTask, bind=True, fence_key=...)``.

    Task options: ``fence_key`` (callable given the task's args and kwargs, returning the stable
    logical key; default: the Celery task id), ``lease_ttl``, ``renew_interval``,
    ``max_attempts`` and any ``fence_<setting>`` to override a setting for this task.
    """

    #: A base of fenced tasks, not one: binding it installs nothing. Declared per class, not
    #: inherited: ``class FlaskTask(FencedTask, fence_base=True)``.
    _fence_base: ClassVar[bool] = True
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None  # the store counts attempts (fence_max_attempts); busy reschedules are free
    #: Settles the exits Celery drives in the worker (hard time limit, expiry, revoke).
    Request = FENCED_REQUEST
    fence_key: Callable[..., str] | None = None
    lease_ttl: float | None = None
    renew_interval: float | None = None
    max_attempts: int | None = None
    #: Unique jobs (:mod:`celery_fence.adapters.unique`): True (the uniqueness key is the task's
    #: name and arguments), or a callable given the task's args and kwargs returning it. While an
    #: unfinished job holds it, a new send returns that job (``fence_unique_on_conflict``).
    fence_unique: bool | Callable[..., str] | None = None
    fence_unique_states: tuple[str, ...] | None = None
    fence_unique_period: float | None = None
    fence_unique_on_conflict: str | None = None
    #: What runs each attempt (the chaos harness's control arms put a demonstration one here).
    _execution_class: type[Execution] = Execution
    #: The worker refuses to start when this task's settings are invalid (``worker_init``).
    settings_checked_at_start = True

    def __init_subclass__(cls, *, fence_base: bool = False, **kwargs: Any) -> None:
        """``fence_base=True`` marks a base of fenced tasks (Flask's app-context base, a
        mixin): Celery binding it installs nothing; each task made from it installs its app.

        A subclass whose ``__call__`` is its own (Flask's documented base task runs
        ``self.run`` inside ``app.app_context()``; a mixin's, too) gets it wrapped: the fenced
        pipeline runs around it, so the body is fenced whatever that ``__call__`` does, and a
        ``super().__call__`` inside it runs ``run`` without fencing twice."""
        super().__init_subclass__(**kwargs)
        cls._fence_base = fence_base
        call = cls.__call__
        if not getattr(call, FENCED_ENTRY, False):
            cls.__call__ = _fenced_entry(call)  # type: ignore[method-assign]

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery binds the task to its app: :func:`~celery_fence.install` that app. A class
        declared with ``fence_base=True`` is a base of fenced tasks, not one: it installs nothing.
        A task whose ``__call__`` was replaced after its class was made (it would run unfenced)
        is refused."""
        super().on_bound(app)
        if not getattr(cls.__call__, FENCED_ENTRY, False):
            raise ConfigurationError(
                f"task {cls.name or cls.__name__}: its __call__ was replaced after the class was "
                "made and would run the task without the fence; define __call__ in the class "
                "body (it then runs fenced), or wrap the work in run()"
            )
        if not cls._fence_base:
            install(app)

    # -- configuration ---------------------------------------------------------------------------

    def fence_config(self) -> FenceConfig:
        return self.fence_backends().config

    def fence_backends(self) -> Backends:
        """This task's settings and this process's backends for them (made again after a fork)."""
        cache: Backends | None = self.__dict__.get("_fence_cache")
        if cache is None or cache.runtime.forked:
            cache = self.__dict__["_fence_cache"] = self._make_backends(FenceConfig.for_task(self))
        return cache

    def _make_backends(self, config: FenceConfig) -> Backends:
        """This process's backends for ``config`` (a demonstration task gives another store)."""
        return backends(config)

    def fence_execution(
        self,
        key: str,
        *,
        message_id: str | None = None,
        hostname: str | None = None,
        retries: int = 0,
        **message: Any,
    ) -> Execution:
        """A new execution of this task for the job ``key`` and a message (its id and worker,
        for the events; ``message``: what else it says, as :class:`Execution` takes it)."""
        config, store, leases, policy, renewer, _ = self.fence_backends()
        trace = tracing.attempt_trace()  # None without opentelemetry-api
        return self._execution_class(
            key,
            task_name=self.name,
            config=config,
            store=store,
            leases=leases,
            renewer=renewer,
            policy=policy,
            announcer=Announcer(
                self, (message_id, hostname), events=config.send_events, trace=trace
            ),
            retries=retries,
            celery_command=celery_command(self.app),
            trace=trace,
            limits=limits_for(config),
            **message,
        )

    def logical_key(self, args: Any, kwargs: Any, task_id: str | None) -> str:
        """The stable logical key of a call: ``fence_key(*args, **kwargs)`` or the task id."""
        fn = None
        for klass in type(self).__mro__:
            if "fence_key" in klass.__dict__:
                raw = klass.__dict__["fence_key"]
                fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                break
        if fn is None:
            if not task_id:
                raise FenceError(
                    f"task {self.name} was called directly without a fence_key: call it with "
                    ".delay()/.apply_async(), or give the task a fence_key=lambda ...: '...'"
                )
            return str(task_id)
        try:
            key = fn(*(args or ()), **(kwargs or {}))
        except Exception as exc:
            raise ConfigurationError(
                f"fence_key of task {self.name} raised {type(exc).__name__}: {exc}; it is called "
                "with the task's own args and kwargs and must return a str"
            ) from exc
        if not valid_key(key):
            raise ConfigurationError(
                f"fence_key of task {self.name} returned a {type(key).__name__} "
                f"({len(key) if isinstance(key, str) else '-'} chars); it must return a non-empty "
                f"str of at most {KEY_LENGTH} characters without NUL (\\x00), e.g. "
                "f'report:{report_id}'"
            )
        return key

    # -- the current attempt ---------------------------------------------------------------------

    @property
    def fence(self) -> Fence:
        fence = getattr(self.request, "fence", None)
        if fence is None:
            raise FenceError(f"self.fence is only available while fenced task {self.name} runs")
        return fence

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.get(IN_SUBCLASS_CALL):  # super().__call__ from a subclass's fenced __call__
            setattr(request, IN_SUBCLASS_CALL, False)
            return self.run(*args, **kwargs)
        return self._fenced_call(args, kwargs, None)

    __call__.__fence_entry__ = True  # type: ignore[attr-defined]

    def _fenced_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[..., Any] | None
    ) -> Any:
        """One fenced attempt around ``run`` (``call`` None) or a subclass's ``__call__``."""
        if self.request.called_directly:  # a plain function call: set up what the tracer does
            _task_stack.push(self)
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._run_fenced(args, kwargs, call)
            finally:
                self.pop_request()
                _task_stack.pop()
        return self._run_fenced(args, kwargs, call)

    # -- one attempt ---------------------------------------------------------------------------

    def _run_fenced(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Callable[..., Any] | None = None,
    ) -> Any:
        request = self.request
        if request.is_eager:
            warnings.warn(
                FenceEagerWarning(
                    f"fenced task {self.name} ran eagerly (task_always_eager or .apply()): no "
                    "worker, no redelivery — fencing is not exercised here. Test it with the "
                    "fenced_worker / fence_chaos fixtures of celery_fence.testing."
                ),
                stacklevel=3,
            )
        try:
            store = self.fence_backends().store  # the settings, read (and checked) once
        except ConfigurationError as exc:  # checked at worker start; still, lose nothing
            logger.critical("fence settings invalid for task %s: %s", self.name, exc)
            return self._carry_out(self._invalid_settings(exc))
        if request.called_directly or request.is_eager:  # in the caller's thread
            return self._run_in_caller(store, args, kwargs, call)
        return self._run_keyed(args, kwargs, call)

    def _run_in_caller(
        self,
        store: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Callable[..., Any] | None,
    ) -> Any:
        """A direct call, ``.apply()`` or an eager run: refused at once inside the caller's
        open transaction on the store's database (:mod:`celery_fence.adapters.direct`); the
        store's idle connections closed afterwards. Its failure is the caller's: the job is left
        ``failed``, never ``retrying`` for recovery to run later (``Execution.in_caller``)."""
        if not isinstance(store, Store):  # a store double: no database
            return self._run_keyed(args, kwargs, call)
        problem = direct.refusal(store, self.name)
        if problem is not None:
            raise FenceError(problem)
        try:
            return self._run_keyed(args, kwargs, call)
        finally:
            direct.release_connections(store)

    def _run_keyed(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Callable[..., Any] | None,
    ) -> Any:
        """This message's key and what it says, then its one execution."""
        request = self.request
        message = {
            "message_id": request.id,
            "hostname": request.hostname,
            "retries": (request.retries or 0) + self._resends(),
        }
        try:
            key = self._key_of(args, kwargs)
            group = self.fence_group_of(args, kwargs, self.fence_backends().config)
        except ConfigurationError as exc:
            if request.called_directly:
                raise
            stored = request_text(self.name, args, kwargs, request)
            decoded = None if stored is None else json.loads(stored)
            unkeyed = self.fence_execution(f"unkeyed:{self.name}:{request.id}", **message)
            return self._carry_out(unkeyed.settle(o.Unkeyed(exc, request.id, decoded)))
        in_caller = ""
        if request.called_directly or request.is_eager:
            in_caller = "eager run" if request.is_eager else "direct call"
        execution = self.fence_execution(
            key,
            **message,
            group=group,
            run_number=self._run_number(),
            takeover=self._takeover(),
            published_at=published_at(request),
            in_caller=in_caller,
            eager=bool(request.is_eager),
        )
        if execution.trace is None:
            return self._run_attempt(execution, args, kwargs, call)
        # the attempt's span is current from the claim until its disposition is carried out
        # (the outbox's deliver task is sent in it)
        with execution.trace.running(self.name, key, execution.attempt_id, request):
            return self._run_attempt(execution, args, kwargs, call)

    def _run_attempt(
        self,
        execution: Execution,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Callable[..., Any] | None,
    ) -> Any:
        request = self.request
        disposition = execution.run(
            functools.partial(self._body, args, kwargs, call),
            request_json=functools.partial(request_text, self.name, args, kwargs, request),
            max_runtime=self._max_runtime(execution.config),
        )
        return self._carry_out(disposition)

    def fence_group_of(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], config: FenceConfig
    ) -> str | None:
        """This call's concurrency group: ``fence_group`` itself (a str), or what it returns
        given ``(args, kwargs)``; None without one."""
        group = config.group
        if group is None or isinstance(group, str):
            return group
        try:
            value = group(tuple(args or ()), dict(kwargs or {}))
        except Exception as exc:
            raise ConfigurationError(
                f"fence_group of task {self.name} raised {type(exc).__name__}: {exc}; it is "
                "called with the task's (args, kwargs) and must return a str"
            ) from exc
        if not isinstance(value, str) or not value or len(value) > KEY_LENGTH:
            raise ConfigurationError(
                f"fence_group of task {self.name} returned a {type(value).__name__}; it must "
                f"return a non-empty str of at most {KEY_LENGTH} characters, e.g. "
                "f'tenant:{kwargs[\"tenant\"]}'"
            )
        return value

    def _invalid_settings(self, error: ConfigurationError) -> o.Disposition:
        """The disposition of a message whose task's settings are invalid: re-sent later."""
        return o.Resend(CONFIG_ERROR_COUNTDOWN, "invalid fence settings", error)

    def _key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """This message's key: the ``fence_key`` header of a recovery's or a requeue's re-send
        (the job's own key), else :meth:`logical_key`."""
        header = None if self.request.called_directly else self.request.get(KEY_HEADER)
        return self.message_key(args, kwargs, self.request.id, header)

    def message_key(self, args: Any, kwargs: Any, task_id: str | None, header: Any) -> str:
        """The key of a message: its ``fence_key`` header when it has one (a recovery's or a
        requeue's re-send names the job's own key, which the arguments may no longer give),
        else :meth:`logical_key`. The body's side and the worker's exits (time limit, expiry,
        revoke) read it the same way."""
        if isinstance(header, str) and header:
            return header
        return self.logical_key(args, kwargs, task_id)

    def _run_number(self) -> int:
        """The operator's re-run this message belongs to: its ``fence_run`` header (set by
        ``fence requeue --completed``, carried by retries and recovery's re-sends); 0 if none."""
        request = self.request
        value = request.get(RUN_HEADER)
        if value is None:
            value = (request.headers or {}).get(RUN_HEADER)  # an eager apply(headers=...)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    def _takeover(self) -> tuple[int, float] | None:
        """(generation taken over, when its row last moved) from a recovery's re-send's
        ``fence_takeover`` header; None for any other message (also the body's own retries of
        one, which Celery sends with its headers)."""
        request = self.request
        if request.called_directly or request.retries:
            return None
        value = request.get(TAKEOVER_HEADER)
        if not isinstance(value, dict):
            return None
        generation, moved = value.get("generation"), value.get("moved")
        if not isinstance(generation, int) or isinstance(generation, bool):
            return None
        if not isinstance(moved, (int, float)) or isinstance(moved, bool):
            return None
        return generation, float(moved)

    def _body(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Callable[..., Any] | None,
        fence: Fence,
    ) -> Any:
        """The task's own ``run`` (or a subclass's ``__call__``, which calls it), with
        ``self.fence`` bound for its duration. An exception Celery's ``retry()`` raised because
        ``max_retries`` is reached ends the job, as in plain Celery (:class:`o.Final`)."""
        request = self.request
        request.fence = fence
        if call is not None:
            setattr(request, IN_SUBCLASS_CALL, True)
        try:
            if call is None:
                return self.run(*args, **kwargs)
            return call(self, *args, **kwargs)
        except Exception as exc:
            if exc is request.get(RETRIES_EXCEEDED):
                raise o.Final(exc, "max_retries exceeded (Celery's retry limit)") from None
            raise
        finally:
            request.fence = None
            setattr(request, IN_SUBCLASS_CALL, False)
            setattr(request, RETRIES_EXCEEDED, None)

    def _max_runtime(self, config: FenceConfig) -> float | None:
        """``fence_max_runtime``, else the hard time limit of this message or task, else None."""
        if config.max_runtime is not None:
            return config.max_runtime
        limit = (self.request.timelimit or (None, None))[0]
        return limit or self.time_limit or self.app.conf.task_time_limit or None
