"""patches.merge_patch is RFC 7386: every example of the RFC's Appendix A, plus the nested-null
case the old implementation got wrong (a new key's object kept its nulls)."""

from __future__ import annotations

import copy
import json

import pytest

from h5ngff.patches import apply_merge_patch, deep_merge, merge_patch

# RFC 7386, Appendix A (original, patch, result), as JSON text.
RFC_7386_EXAMPLES = [
    ('{"a":"b"}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"b"}', '{"b":"c"}', '{"a":"b","b":"c"}'),
    ('{"a":"b"}', '{"a":null}', "{}"),
    ('{"a":"b","b":"c"}', '{"a":null}', '{"b":"c"}'),
    ('{"a":["b"]}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"c"}', '{"a":["b"]}', '{"a":["b"]}'),
    ('{"a":{"b":"c"}}', '{"a":{"b":"d","c":null}}', '{"a":{"b":"d"}}'),
    ('{"a":[{"b":"c"}]}', '{"a":[1]}', '{"a":[1]}'),
    ('["a","b"]', '["c","d"]', '["c","d"]'),
    ('{"a":"b"}', '["c"]', '["c"]'),
    ('{"a":"foo"}', "null", "null"),
    ('{"a":"foo"}', '"bar"', '"bar"'),
    ('{"e":null}', '{"a":1}', '{"e":null,"a":1}'),
    ("[1,2]", '{"a":"b","c":null}', '{"a":"b"}'),
    ("{}", '{"a":{"bb":{"ccc":null}}}', '{"a":{"bb":{}}}'),
]


@pytest.mark.parametrize("original, patch, result", RFC_7386_EXAMPLES)
def test_rfc_7386_appendix_a(original, patch, result):
    target, change = json.loads(original), json.loads(patch)
    before = copy.deepcopy((target, change))
    assert merge_patch(target, change) == json.loads(result)
    assert (target, change) == before  # inputs untouched
    if isinstance(target, dict) and isinstance(change, dict):
        assert apply_merge_patch(target, change) == json.loads(result)


def _old_apply_merge_patch(document, patch):
    """The implementation before issue 17, kept here as the negative control."""
    out = dict(document)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _old_apply_merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def test_negative_control_the_old_merge_kept_nested_nulls():
    failing = [
        (o, p, r)
        for o, p, r in RFC_7386_EXAMPLES
        if o.startswith("{")
        and p.startswith("{")
        and _old_apply_merge_patch(json.loads(o), json.loads(p)) != json.loads(r)
    ]
    assert failing == [("{}", '{"a":{"bb":{"ccc":null}}}', '{"a":{"bb":{}}}')]


def test_a_status_patch_that_adds_an_object_with_a_cleared_field():
    """The operator's case: a first ``progress`` patch that also clears a field it never had."""
    status = {"phase": "Pending"}
    patch = {"phase": "Running", "progress": {"slabsDone": 3, "eta": None}}
    assert apply_merge_patch(status, patch) == {"phase": "Running", "progress": {"slabsDone": 3}}


def test_combining_two_patches_keeps_the_nulls_until_applied():
    first, second = {"progress": {"eta": 5}}, {"progress": {"eta": None}, "message": None}
    combined = deep_merge(first, second)
    assert combined == {"progress": {"eta": None}, "message": None}
    assert apply_merge_patch({"message": "x", "progress": {"eta": 9, "done": 1}}, combined) == {"progress": {"done": 1}}
