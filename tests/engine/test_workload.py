"""Workloads: the Mooncake reader against the trace's published facts, and the generator."""

import itertools
import json

import pytest

from kvscope.engine.workload import SyntheticConfig, TraceError, read_mooncake, synthetic
from kvscope.events import block_token_counts
from traces import trace_path


def test_mooncake_conversation_trace_matches_its_published_facts():
    """shared/traces/README.md: 12,031 requests, 288,500 block accesses, 182,790 unique ids,
    and 0.3664 of accesses reuse an id seen before."""
    requests = read_mooncake(trace_path())
    assert len(requests) == 12_031
    accesses = [h for r in requests for h in r.block_hashes]
    assert len(accesses) == 288_500
    assert len(set(accesses)) == 182_790
    assert round(1 - len(set(accesses)) / len(accesses), 4) == 0.3664
    assert all(a.arrival <= b.arrival for a, b in zip(requests, requests[1:]))


def test_block_token_counts_split_a_prompt():
    assert block_token_counts(1100, 3, 512) == [512, 512, 76]
    assert block_token_counts(1024, 2, 512) == [512, 512]


@pytest.mark.parametrize("line,message", [
    ("not json", r"not JSON \(Expecting value column 1\)"),
    # a line cut short: json's message ends "starting at", its position given apart
    ('{"timestamp": 0, "input_length": 10, "hash_', "Unterminated string starting at column 38"),
    ('["a list"]', "JSON object"),
    ('{"timestamp": 0, "input_length": 10}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": ["x"]}', "hash_ids"),
    ('{"timestamp": "soon", "input_length": 10, "hash_ids": [1]}', "numbers"),
    ('{"timestamp": 0, "input_length": -5, "hash_ids": [1, 2]}', ">= 0"),
    # 1024 tokens fill 2 blocks of 512: nine ids were once read as 9 x 512 tokens, unremarked
    ('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}',
     "9 hash_ids, but an input_length of 1024 tokens fills 2 blocks of 512"),
    # and one id for 10^8 tokens: blocks no id names (a replay said TTFT 505 s)
    ('{"timestamp": 0, "input_length": 100000000, "hash_ids": [1]}',
     "1 hash_ids, but an input_length of 100000000 tokens fills 195313 blocks of 512"),
])
def test_malformed_trace_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_a_last_line_cut_short_is_said_to_be_so(tmp_path):
    """The first 100,000 bytes of a trace end inside a record: the error named the line only.
    A last line that does not parse and has no newline after it is said to look cut short;
    the same line with its newline, or followed by others, is not."""
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    cut = '{"timestamp": 0, "input_length": 10, "hash_'
    for text, said in ((f"{good}\n{cut}", True), (f"{good}\n{cut}\n", False),
                       (f"{cut}\n{good}", False)):
        path = tmp_path / "t.jsonl"
        path.write_text(text)
        with pytest.raises(TraceError, match="not JSON") as error:
            read_mooncake(path)
        assert str(error.value).endswith("was the file cut short?") is said, text


def test_a_trace_plays_from_its_first_request(tmp_path):
    """A trace's tail (first timestamp 3,480,000 ms) and one in Unix milliseconds: arrivals
    count from the first request, 0, 1 ms and 2.5 s (the replay and the demo waited out
    3,480 s, or for ever, before the first request; analyze had counted from the first
    already). Subtracted in milliseconds: in seconds, 1 ms after 1.733e9 s read 0.99993 ms."""
    for first in (3_480_000, 1_733_000_000_000):
        path = tmp_path / f"t{first}.jsonl"
        path.write_text("".join(json.dumps({"timestamp": first + dt, "input_length": 10,
                                            "hash_ids": [1]}) + "\n" for dt in (2500, 0, 1)))
        assert [r.arrival for r in read_mooncake(path)] == [0.0, 0.001, 2.5]


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_mooncake(tmp_path / "absent.jsonl")
    # a capture directory given to replay said only "Is a directory"
    with pytest.raises(TraceError, match="a directory, not a Mooncake JSONL file"):
        read_mooncake(tmp_path)


def test_synthetic_is_seeded_and_shares_prefixes():
    first = list(itertools.islice(synthetic(SyntheticConfig(seed=1)), 500))
    again = list(itertools.islice(synthetic(SyntheticConfig(seed=1)), 500))
    other = list(itertools.islice(synthetic(SyntheticConfig(seed=2)), 500))
    assert first == again and first != other
    arrivals = [r.arrival for r in first]
    assert arrivals == sorted(arrivals)
    # Poisson arrivals at 20/s: 500 arrivals take about 25 s (5 sigma is about 5.6 s)
    assert 19 < arrivals[-1] < 31
    accesses = [h for r in first for h in r.block_hashes]
    assert len(set(accesses)) < 0.7 * len(accesses)  # system prompts and sessions are reused
    for r in first:
        assert len(r.block_hashes) == -(-r.prompt_tokens // 16)


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00garbage\n", "not UTF-8"),
    (b"", "no requests"),
    (b"\n\n", "no requests"),
])
def test_unreadable_or_empty_traces(tmp_path, content, message):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        read_mooncake(path)
