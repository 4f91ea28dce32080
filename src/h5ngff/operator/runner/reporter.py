"""The runner pod's status reports: merge patches of ``conversionjobs/<name>/status``.

Reports go out from a background thread with its own event loop, so a slow API server never
stalls the conversion: while one patch is in flight, newer progress replaces older progress
(only the latest matters). The final report of an attempt is retried until it is delivered or
``FINAL_TIMEOUT`` passes, because the operator decides about retries from it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from ...jobspec import API_VERSION, PLURAL
from ..kube import Kube, KubeConfig, KubeError, namespaced
from ..schema.status import combine

log = logging.getLogger(__name__)

#: Seconds the runner keeps trying to deliver its final report before giving up (the operator
#: then falls back on the pod's exit status).
FINAL_TIMEOUT = 60.0
RETRY_DELAYS = (0.5, 1, 2, 4, 8)
RUNNER_AGENT = "h5ngff-runner"


#: Seconds an idle reporter's wait lasts before it looks again (see ``_take``).
TAKE_WAIT = 1.0


class StatusReporter:
    """``reporter(patch, final)`` queues a status patch for one ConversionJob (or, with ``plural``
    conversionbatches, one ConversionBatch)."""

    def __init__(self, namespace: str, name: str, cfg: KubeConfig | None = None, plural: str = PLURAL):
        self.path = namespaced(API_VERSION, namespace, plural, name, "status")
        self.cfg = cfg or KubeConfig.from_env()
        self._pending: dict[str, Any] | None = None
        self._final = False
        self._cond = threading.Condition()
        self._closed = False
        self.delivered = 0
        self._thread = threading.Thread(target=self._main, name="h5ngff-status-reporter", daemon=True)
        self._thread.start()

    def __call__(self, patch: dict[str, Any], final: bool = False) -> None:
        with self._cond:
            # Coalesce: a merge of two merge patches is what applying both in order would do.
            self._pending = combine(self._pending, patch) if self._pending else dict(patch)
            self._final = self._final or final
            self._cond.notify()
        if final:
            self.flush(FINAL_TIMEOUT)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued was delivered (or ``timeout`` passes)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None, timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _take(self) -> tuple[dict[str, Any] | None, bool] | None:
        """The next patch, (None, _) once closed, or None after a second of nothing: the wait
        runs in an executor thread, which the interpreter joins at exit, so it must end even for
        a reporter nobody closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending is not None or self._closed, TAKE_WAIT):
                return None
            return self._pending, self._final

    def _main(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        kube = await Kube.connect(self.cfg, agent=RUNNER_AGENT)
        try:
            while True:
                taken = await asyncio.to_thread(self._take)
                if taken is None:
                    continue
                patch, final = taken
                if patch is None:
                    return
                await self._deliver(kube, patch, final)
                with self._cond:
                    if self._pending is patch:
                        self._pending = None  # nothing newer arrived meanwhile
                        self._final = False
                    self._cond.notify_all()
        finally:
            await kube.close()

    async def _deliver(self, kube: Kube, patch: dict[str, Any], final: bool) -> None:
        delays = RETRY_DELAYS if final else RETRY_DELAYS[:2]
        for delay in (*delays, None):
            try:
                await kube.patch_merge(self.path, {"status": patch})
                self.delivered += 1
                return
            except KubeError as exc:
                if delay is None:
                    log.warning("could not report status to %s: %s", self.path, exc)
                    return
                log.info("status report failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
