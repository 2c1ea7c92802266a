"""How a published version reaches the engines (pipeline.supervisor.lineage), against the SGLang fake."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeline.contracts import events
from pipeline.tools.fake_sglang import FakeSGLang
from tests.helpers.lineage import lineage_for


async def test_versions_reach_the_engines_in_order_and_never_go_backwards(tmp_path: Path) -> None:
    fake = FakeSGLang()
    await fake.start()
    under = lineage_for([fake.base_url], tmp_path / "run")
    try:
        for v in (1, 3, 2, 3):  # 2 arrives late; 3 again is no news
            await under.lineage.on_published(events.Published(version=v, path=f"/run/weights/v{v}"))
    finally:
        await under.close()
        await fake.stop()
    assert [c["weight_version"] for c in fake.update_calls] == ["1", "3"]
    assert under.lineage.version == 3 and under.served == [1, 3]


async def test_a_learner_restarted_alone_takes_the_engines_back_to_its_checkpointed_version(
    tmp_path: Path,
) -> None:
    fake = FakeSGLang()
    await fake.start()
    under = lineage_for([fake.base_url], tmp_path / "run")
    lineage = under.lineage
    try:
        await lineage.on_ready(events.Ready(version=0, step=0, consumed_seq=0, path="/m"), restarted=False)
        for v in (1, 2, 3, 4):
            await lineage.on_published(events.Published(version=v, path=f"/run/weights/v{v}"))
        # The learner dies after its checkpoint at version 2; the restarted one resumes there and trains
        # the groups after it again, re-publishing version 3 with new weights.
        ready = events.Ready(version=2, step=2, consumed_seq=8, path="/run/weights/v2")
        await lineage.on_ready(ready, restarted=True)
        await lineage.on_published(events.Published(version=3, path="/run/weights/v3"))
    finally:
        await under.close()
        await fake.stop()
    assert [c["weight_version"] for c in fake.update_calls] == ["1", "2", "3", "4", "2", "3"]
    assert fake.update_calls[-2]["model_path"] == "/run/weights/v2"
    assert lineage.version == 3
    assert under.served == [1, 2, 3, 4, 2, 3]
    assert "learner restarted from its checkpoint at step 2" in under.progress.getvalue()


async def test_nothing_is_synced_once_the_daemon_is_stopping(tmp_path: Path) -> None:
    """A served-policy failure stops the daemon while the learner's next versions are still queued: they
    must not be loaded (and checked, and reported as more failures) on the way out."""
    fake = FakeSGLang()
    await fake.start()
    under = lineage_for([fake.base_url], tmp_path / "run")
    try:
        await under.lineage.on_published(events.Published(version=1, path="/run/weights/v1"))
        under.lineage.stopping.set()
        await under.lineage.on_published(events.Published(version=2, path="/run/weights/v2"))
    finally:
        await under.close()
        await fake.stop()
    assert [c["weight_version"] for c in fake.update_calls] == ["1"]
    assert under.lineage.version == 1 and under.served == [1]


async def test_syncs_run_one_at_a_time_in_the_order_the_events_came(tmp_path: Path) -> None:
    fake = FakeSGLang()
    await fake.start()
    under = lineage_for([fake.base_url], tmp_path / "run")
    try:
        await asyncio.gather(
            *(
                under.lineage.on_published(events.Published(version=v, path=f"/run/weights/v{v}"))
                for v in (1, 2, 3)
            )
        )
    finally:
        await under.close()
        await fake.stop()
    assert [c["weight_version"] for c in fake.update_calls] == ["1", "2", "3"]
