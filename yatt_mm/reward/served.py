"""What a client of a served scorer shares, a GenRM judge (yatt_mm/reward/genrm.py `ServerJudge`)
or a distillation teacher (yatt_mm/reward/teacher.py `ServerTeacher`): the server it owns, its
API key, one HTTP session, images encoded once per prompt, requests with a timeout and bounded
retries with exponential backoff, and `score(items)` over the async `score_one(item)`.

A subclass sets `stats` and writes `score_one` with `_post`; `cfg` needs `api_key_env`,
`timeout_s`, `retries` and `backoff_s`."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from typing import Any, Callable


def data_url_image(image) -> str:
    """A PIL image as a PNG data URL (lossless: the server sees the pixels the policy saw)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class ServedClient:
    def __init__(self, cfg, base_url: str, server=None):
        self.cfg = cfg
        self.base_url = base_url.rstrip("/")
        self.server = server  # the server process this client owns (stopped by close()), if any
        self.node_pids: list[int] = []  # the owner's: the ranks on the server's node (yatt_mm/reward/judges.py)
        self._client = None
        # the server's API key, as vLLM takes it; read here, so it lives in this process's memory
        # and environment only (never in a log line, a setting or a metric)
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        # a prompt's n responses share its images: each is encoded once (the image is kept, so
        # its id is not reused while the entry lives); cleared with the session
        self._image_urls: dict[int, tuple[object, str]] = {}

    def _image_url(self, image) -> str:
        key = id(image)
        if key not in self._image_urls:
            self._image_urls[key] = (image, data_url_image(image))
        return self._image_urls[key][1]

    async def _post(self, path: str, payload: dict, read: Callable[[dict], Any],
                    final: frozenset[int] = frozenset()) -> tuple[Any, str | None]:
        """POST `payload` to the server's `path`: (read(the 200 answer's JSON), None), or after the
        retries (None, why: "timeout", "unreachable" or "http_<status>"). A status in `final`
        is not retried (the request itself was refused)."""
        # aiohttp (a dependency of vLLM): its client costs the caller 4-8x less CPU per request
        # than httpx (measured: 64 requests, 0.06 s vs 0.24-0.5 s), CPU the rollout engine
        # beside it needs under partial colocation
        import aiohttp

        if self._client is None:
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
                                                 headers=self._headers)
        failure = "unreachable"
        for attempt in range(self.cfg.retries + 1):
            try:
                async with self._client.post(f"{self.base_url}{path}", json=payload) as resp:
                    if resp.status == 200:
                        return read(await resp.json()), None
                    failure = f"http_{resp.status}"
                    if resp.status in final:
                        return None, failure
            except asyncio.TimeoutError:
                failure = "timeout"
            except aiohttp.ClientError:
                failure = "unreachable"
            if attempt < self.cfg.retries:
                await asyncio.sleep(self.cfg.backoff_s * 2**attempt)
        return None, failure

    async def score_one(self, item):
        raise NotImplementedError

    def score(self, items: list) -> list:
        async def all_items():
            try:
                return await asyncio.gather(*(self.score_one(it) for it in items))
            finally:
                await self.aclose()

        return list(asyncio.run(all_items()))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    async def aclose(self) -> None:
        self._image_urls.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None
