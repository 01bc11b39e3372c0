"""The reuse index (client/serve/reuse.py), in-process."""

from __future__ import annotations

from types import SimpleNamespace

from muxworker.client.serve.reuse import ReuseIndex, common_prefix
from muxworker.client.serve.tenants import IMPLICIT, RESPONSE, Tenant, session_kind

T = Tenant("t")


def _result(generated, committed=None):
    return SimpleNamespace(
        generated_token_ids=list(generated),
        committed_tokens=len(generated) if committed is None else committed,
        reused_prompt_tokens=0,
        prefilled_prompt_tokens=0,
    )


def _turn(index, plan, prompt, reply):
    index.note_turn(plan.target, prompt, _result(reply))


def test_common_prefix():
    import numpy as np

    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix(a, np.array([1, 2, 9], np.int32)) == 2
    assert common_prefix(a, np.array([1, 2], np.int32)) == 2
    assert common_prefix(a, np.array([], np.int32)) == 0


def test_a_resent_history_continues_in_place_turn_after_turn():
    index = ReuseIndex()
    p1 = list(range(100))
    first = index.plan(T, p1)
    assert first.fresh_target and first.source is None and session_kind(first.target) == IMPLICIT
    _turn(index, first, p1, [500, 501, 2])
    # The next turn resends the history: the reply re-rendered (its stop token differs) and more.
    p2 = p1 + [500, 501, 7, 8, 9]
    second = index.plan(T, p2)
    assert second.target == first.target and not second.fresh_target and second.reused == 102
    _turn(index, second, p2, [600, 2])
    entry = index.get(first.target)
    assert entry.prompt_len == len(p2) and entry.rows == len(p2) + 1 and not entry.busy


def test_a_divergent_prompt_forks_and_both_branches_stay_reusable():
    index = ReuseIndex()
    base = list(range(50))
    a = index.plan(T, base + [1000, 1001])
    _turn(index, a, base + [1000, 1001], [7, 2])
    # Another request shares the first 50 tokens only: a branch, the first history kept.
    b = index.plan(T, base + [2000])
    assert b.fresh_target and b.source == a.target and b.rows == 50
    _turn(index, b, base + [2000], [8, 2])
    again = index.plan(T, base + [1000, 1001, 7, 2, 3])
    assert again.target == a.target and again.reused == 53
    index.release(again.target)
    other = index.plan(T, base + [2000, 8, 2, 4])
    assert other.target == b.target


def test_a_busy_session_is_forked_not_shared():
    index = ReuseIndex()
    p = list(range(20))
    a = index.plan(T, p)
    _turn(index, a, p, [5, 2])
    first = index.plan(T, p + [5, 2, 9])
    second = index.plan(T, p + [5, 2, 9])  # the same conversation twice at once
    assert first.target == a.target and second.fresh_target and second.source == a.target


def test_response_sessions_are_only_forked_by_requests_of_another_kind():
    index = ReuseIndex()
    p = list(range(30))
    r = index.plan(T, p, RESPONSE)
    assert session_kind(r.target) == RESPONSE
    _turn(index, r, p, [4, 2])
    chat = index.plan(T, p + [4, 2, 5])
    assert chat.fresh_target and chat.source == r.target and session_kind(chat.target) == IMPLICIT
    index.release(chat.target)
    cont = index.plan(T, p + [4, 2, 6], RESPONSE)
    assert cont.target == r.target


def test_cache_salts_never_see_each_other_and_a_turn_that_never_ran_keeps_the_history():
    index = ReuseIndex()
    p = list(range(30))
    a = index.plan(T, p, salt="alice")
    _turn(index, a, p, [1, 2])
    assert index.plan(T, p + [1, 2, 3], salt="bob").source is None  # another salt: fresh
    again = index.plan(T, p + [1, 2, 3], salt="alice")
    assert again.target == a.target
    index.note_turn(again.target, p + [1, 2, 3], None, ran=False)  # refused at submit (too long, say)
    entry = index.get(a.target)
    assert entry.rows == 31 and not entry.busy


def test_tenants_never_see_each_other():
    index = ReuseIndex()
    p = list(range(30))
    a = index.plan(T, p)
    _turn(index, a, p, [1, 2])
    other = index.plan(Tenant("u"), p + [1, 2, 3])
    assert other.source is None and other.fresh_target


def test_a_named_session_keeps_the_history_a_divergent_turn_overwrites():
    index = ReuseIndex()
    sid = "t/chat"
    convo = list(range(40))
    plan = index.plan_named(T, sid, convo)
    assert plan.target == sid and plan.branch is None
    _turn(index, plan, convo, [5, 2])
    # aider's summarize request under the same header: shares the first 10 tokens.
    summary = convo[:10] + [900, 901]
    plan = index.plan_named(T, sid, summary)
    assert plan.branch is not None and session_kind(plan.branch) == IMPLICIT
    _turn(index, plan, summary, [3, 2])
    # Back to the conversation: the branch holds it, and is copied into the named session.
    back = index.plan_named(T, sid, convo + [5, 2, 77])
    assert back.source == plan.branch and back.rows == 41 and back.branch is not None


def test_a_history_read_back_after_a_restart_is_continued_or_branched_by_its_share():
    index = ReuseIndex()
    history = list(range(100))
    index.add("t/chat")
    index.loaded("t/chat", history)  # its last prompt's length is unknown
    # The conversation goes on (its last reply re-rendered from token 95): continued in place.
    assert index.plan_named(T, "t/chat", history[:95] + [7, 8]).branch is None
    index.release("t/chat")
    # A side request sharing the first 20 tokens: the history is kept as a branch first.
    assert index.plan_named(T, "t/chat", history[:20] + [9]).branch is not None


def test_failed_turn_and_bound():
    index = ReuseIndex()
    index.bytes_per_token = 10.0
    plans = []
    for i in range(4):
        p = [1000 * (i + 1) + j for j in range(100)]
        plans.append(index.plan(T, p))
        _turn(index, plans[-1], p, [1, 2])
    assert index.implicit_bytes(T) == 4 * 101 * 10
    doomed = index.over_bound(T, 2 * 101 * 10)
    assert [e.sid for e in doomed] == [plans[0].target, plans[1].target]  # least recently used first
    index.note_turn(plans[3].target, [1], None)  # a failed turn empties the session
    assert index.get(plans[3].target).rows == 0
