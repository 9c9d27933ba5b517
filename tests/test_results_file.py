"""The result files' writer (sglang_elastic.results): layout and round trip."""

from __future__ import annotations

import json
import random
import re

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_elastic import results

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(alphabet=st.characters(codec="utf-8"), max_size=12))
_json = st.recursive(_scalar, lambda c: st.one_of(st.lists(c, max_size=5), st.dictionaries(st.text(max_size=6), c, max_size=5)),
                     max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_any_result_reads_back_equal(x):
    """Strings with brackets, braces, quotes and newlines included: only whitespace between items moves."""
    assert json.loads(results.dumps(x)) == x


def test_lists_of_plain_values_stay_on_one_line_and_the_rest_one_item_per_line(tmp_path):
    rnd = random.Random(4)
    row = [rnd.random() for _ in range(5)]
    d = {"rows": [row, ["a]b", "c{", None, True]], "cases": [{"name": "B1", "lens": [1, 2, 3]}], "empty": [], "note": "x\ny"}
    p = tmp_path / "r.json"
    results.write(str(p), d)
    text = p.read_text()
    assert json.loads(text) == d and text.endswith("\n")
    assert json.dumps(row, separators=(",", ":")) in text  # a table row on one line
    assert '"lens":[1,2,3]' in text
    assert '["a]b","c{",null,true]' not in text  # a string with a bracket keeps the one-item-per-line layout (still valid)
    assert '\n "cases":[\n  {\n' in text  # lists of objects: one item per line


def test_read_json_opens_each_kept_form_and_names_a_damaged_one(tmp_path):
    """read_json: plain, .xz and .gz give the same object; a truncated or damaged stream is a ValueError naming the file."""
    import gzip
    import lzma

    rnd = random.Random()
    d = {"commit": "%040x" % rnd.getrandbits(160), "rows": [[rnd.random() for _ in range(4)] for _ in range(3)]}
    raw = json.dumps(d).encode()
    forms = {"r.json": raw, "r.json.xz": lzma.compress(raw), "r.json.gz": gzip.compress(raw)}
    for name, data in forms.items():
        (tmp_path / name).write_bytes(data)
        assert results.read_json(str(tmp_path / name)) == d, name
    for name in ("r.json.xz", "r.json.gz"):
        bad = tmp_path / f"cut.{name}"
        bad.write_bytes(forms[name][: len(forms[name]) // 2])
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            results.read_json(str(bad))
    (tmp_path / "junk.json.xz").write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match="junk.json.xz"):
        results.read_json(str(tmp_path / "junk.json.xz"))
