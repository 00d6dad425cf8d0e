"""Token shards: round trip, validation of every bad input, multi-shard consistency."""
import json
import struct
import zlib

import numpy as np
import pytest
import torch

from vqlcmd.data.shards import ShardError, TokenShardDataset, open_shard, write_shard

HEADER = dict(codebook_size=50, grid=[2, 3], tokenizer_id="tok-a", num_classes=4, class_names=list("abcd"))


def _data(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, (n, 2, 3)), rng.integers(0, 4, n)


def test_round_trip_and_header(tmp_path):
    toks, labs = _data()
    write_shard(tmp_path / "s-0.vqtok", toks, labs, dict(HEADER, source="unit"))
    write_shard(tmp_path / "s-1.vqtok", toks[:3] + 0, labs[:3], HEADER)
    ds = TokenShardDataset(tmp_path)
    assert len(ds) == 13 and ds.seq_len == 6
    h = ds.header
    assert (h["codebook_size"], h["grid"], h["tokenizer_id"], h["num_classes"], h["class_names"]) == \
        (50, [2, 3], "tok-a", 4, list("abcd"))
    t, y = ds[11]
    assert t.dtype == torch.int64 and t.shape == (6,) and y.dtype == torch.int64
    assert t.tolist() == toks[1].reshape(-1).tolist() and int(y) == labs[1]
    bt, by = ds.gather([0, 12, 5])
    assert bt.shape == (3, 6) and bt.dtype == torch.int64
    assert bt[1].tolist() == toks[2].reshape(-1).tolist() and by.tolist() == [labs[0], labs[2], labs[5]]
    at, al = ds.arrays()
    assert at.shape == (13, 6) and at.dtype == np.uint16 and al.dtype == np.int64


def test_torch_input_and_flat_tokens(tmp_path):
    toks, labs = _data()
    write_shard(tmp_path / "s.vqtok", torch.from_numpy(toks).reshape(10, 6), torch.from_numpy(labs), HEADER)
    s = open_shard(tmp_path / "s.vqtok")
    assert isinstance(s.tokens, np.memmap) and s.tokens.dtype == np.uint16


def test_write_is_atomic_no_temp_left(tmp_path):
    write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    assert [p.name for p in tmp_path.iterdir()] == ["s.vqtok"]


@pytest.mark.parametrize("bad, match", [
    (dict(tokens=np.full((2, 6), 50)), r"token ids must lie in \[0, 50\).*max 50"),
    (dict(tokens=np.full((2, 6), -1)), r"min -1"),
    (dict(labels=np.array([0, 4])), r"labels must lie in \[0, 4\).*max 4"),
    (dict(labels=np.array([-1, 0])), r"labels.*min -1"),
    (dict(tokens=np.zeros((2, 6), np.float32)), r"tokens must be integers, got dtype float32"),
    (dict(labels=np.zeros(2, bool)), r"labels must be integers, got dtype bool"),
    (dict(tokens=np.zeros((2, 5), np.int64)), r"tokens must be \(N, 2, 3\)"),
    (dict(labels=np.zeros(3, np.int64)), r"labels must be \(2,\)"),
])
def test_write_rejects_bad_inputs(tmp_path, bad, match):
    args = dict(tokens=np.zeros((2, 6), np.int64), labels=np.zeros(2, np.int64))
    args.update(bad)
    with pytest.raises(ShardError, match=match) as e:
        write_shard(tmp_path / "bad.vqtok", args["tokens"], args["labels"], HEADER)
    assert "bad.vqtok" in str(e.value)
    assert not (tmp_path / "bad.vqtok").exists()


def test_write_rejects_bad_header_and_suffix(tmp_path):
    with pytest.raises(ShardError, match="lacks.*tokenizer_id"):
        write_shard(tmp_path / "a.vqtok", *_data(), {k: v for k, v in HEADER.items() if k != "tokenizer_id"})
    with pytest.raises(ShardError, match="3 class names for num_classes=4"):
        write_shard(tmp_path / "a.vqtok", *_data(), dict(HEADER, class_names=list("abc")))
    with pytest.raises(ShardError, match="does not fit uint16"):
        write_shard(tmp_path / "a.vqtok", *_data(), dict(HEADER, codebook_size=70000))
    with pytest.raises(ValueError, match="must end in .vqtok"):
        write_shard(tmp_path / "a.npy", *_data(), HEADER)


def _raw(path):
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[8:16])
    return b, n


def test_truncated_shard(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b, _ = _raw(p)
    p.write_bytes(b[:-7])
    with pytest.raises(ShardError, match=r"s\.vqtok: file truncated"):
        TokenShardDataset(tmp_path)
    p.write_bytes(b[:20])
    with pytest.raises(ShardError, match="header length .* does not fit"):
        open_shard(p)


def test_trailing_bytes_and_bad_magic(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b, _ = _raw(p)
    p.write_bytes(b + b"xx")
    with pytest.raises(ShardError, match="trailing bytes"):
        open_shard(p)
    p.write_bytes(b"PK\x03\x04" + b[4:])
    with pytest.raises(ShardError, match="not a token shard"):
        open_shard(p)


def test_corrupt_data_fails_the_checksum(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b, n = _raw(p)
    b = bytearray(b)
    b[16 + n + 3] ^= 0x01  # one flipped bit inside the token array, still a valid id
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError, match=r"s\.vqtok: checksum mismatch"):
        open_shard(p)
    assert len(open_shard(p, verify=False)) == 10  # without verification it opens (caller's choice)


@pytest.mark.parametrize("old, new", [(b'"codebook_size": 50', b'"codebook_size": 58'),
                                      (b'"class_names": ["a", "b"', b'"class_names": ["a", "c"')])
def test_a_flipped_header_value_fails_the_header_checksum(tmp_path, old, new):
    """The arrays' CRC does not cover the header; a one-shard set has no other header to compare with."""
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b = p.read_bytes()
    assert b.count(old) == 1
    p.write_bytes(b.replace(old, new))
    with pytest.raises(ShardError, match=r"s\.vqtok: header checksum mismatch"):
        open_shard(p, verify=False)
    with pytest.raises(ShardError, match="header checksum mismatch"):
        TokenShardDataset(tmp_path)


def test_a_shard_from_before_the_header_checksum_still_opens(tmp_path):
    toks, labs = _data()
    p = write_shard(tmp_path / "s.vqtok", toks, labs, HEADER)
    assert "header_crc32" in json.loads(_raw(p)[0][16:16 + _raw(p)[1]])
    _edit_header(p)  # drops the field, as older writers did
    s = open_shard(p)
    assert "header_crc32" not in s.header and s.tokens.tolist() == toks.reshape(10, 6).tolist()


def test_corrupt_header_json(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b, n = _raw(p)
    p.write_bytes(b[:16] + b"{" * n + b[16 + n:])
    with pytest.raises(ShardError, match="header is not valid JSON"):
        open_shard(p)


def _edit_header(path, **changes):
    """Rewrites header fields as a shard from before the header's CRC (which had none) would hold them."""
    b, n = _raw(path)
    h = json.loads(b[16:16 + n])
    h.update(changes)
    h.pop("header_crc32")
    body = json.dumps(h).encode()
    assert len(body) <= n
    path.write_bytes(b[:16] + body + b" " * (n - len(body)) + b[16 + n:])


def test_out_of_range_ids_in_a_written_file(tmp_path):
    # ids valid for K=50 but the header claims K=10: caught on opening, naming the shard
    p = write_shard(tmp_path / "s.vqtok", np.full((2, 6), 40), np.zeros(2, np.int64), HEADER)
    _edit_header(p, codebook_size=10)
    with pytest.raises(ShardError, match=r"s\.vqtok: token ids must lie in \[0, 10\)"):
        open_shard(p)


def test_wrong_dtype_in_header(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    _edit_header(p, tokens_dtype="int32")
    with pytest.raises(ShardError, match="expected uint16 tokens"):
        open_shard(p)


@pytest.mark.parametrize("key, value", [("tokenizer_id", "tok-b"), ("codebook_size", 60), ("grid", [3, 2]),
                                        ("class_names", list("abce"))])
def test_header_mismatch_between_shards(tmp_path, key, value):
    write_shard(tmp_path / "s-0.vqtok", *_data(), HEADER)
    toks, labs = _data()
    write_shard(tmp_path / "s-1.vqtok", toks.reshape(len(toks), -1), labs, dict(HEADER, **{key: value}))
    with pytest.raises(ShardError, match=rf"s-1\.vqtok: header mismatch on '{key}'.*s-0\.vqtok"):
        TokenShardDataset(tmp_path)


def test_missing_or_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no"):
        TokenShardDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TokenShardDataset(tmp_path / "nowhere")


def test_unconditional_shard_uses_label_zero(tmp_path):
    write_shard(tmp_path / "u.vqtok", np.zeros((3, 6), np.int64), np.zeros(3, np.int64),
                dict(HEADER, num_classes=0, class_names=[]))
    assert TokenShardDataset(tmp_path).num_classes == 0
    with pytest.raises(ShardError, match=r"labels must lie in \[0, 1\)"):
        write_shard(tmp_path / "v.vqtok", np.zeros((2, 6), np.int64), np.ones(2, np.int64),
                    dict(HEADER, num_classes=0, class_names=[]))


def _put_header(path, h):
    if isinstance(h, dict):
        h.pop("header_crc32", None)  # a shard from before the header's CRC
    b, n = _raw(path)
    body = json.dumps(h).encode()
    assert len(body) <= n
    path.write_bytes(b[:16] + body + b" " * (n - len(body)) + b[16 + n:])


@pytest.mark.parametrize("edit, match", [
    (lambda h: h.pop("count"), r"count must be a non-negative int, got None"),
    (lambda h: h.update(count="ten"), r"count must be a non-negative int, got 'ten'"),
    (lambda h: h.update(count=-1), r"count must be a non-negative int, got -1"),
    (lambda h: h.update(grid=4), r"grid must be \[h, w\] of positive ints, got 4"),
    (lambda h: h.update(grid=[2.5, 2]), r"grid must be \[h, w\] of positive ints, got \[2.5, 2\]"),
    (lambda h: h.update(codebook_size="big"), r"codebook_size must be a non-negative int, got 'big'"),
    (lambda h: h.update(num_classes=2.7), r"num_classes must be a non-negative int, got 2.7"),
    (lambda h: h.update(num_classes=True), r"num_classes must be a non-negative int, got True"),
    (lambda h: h.update(class_names="abcd"), r"class_names must be a list of strings, got 'abcd'"),
])
def test_malformed_header_fields_are_shard_errors_naming_the_shard(tmp_path, edit, match):
    """Each used to be a bare KeyError / TypeError / ValueError, or was read as another value silently."""
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    b, n = _raw(p)
    h = json.loads(b[16:16 + n])
    edit(h)
    _put_header(p, h)
    with pytest.raises(ShardError, match=r"s\.vqtok: .*" + match):
        open_shard(p)


def test_a_header_that_is_not_an_object(tmp_path):
    p = write_shard(tmp_path / "s.vqtok", *_data(), HEADER)
    _put_header(p, None)
    with pytest.raises(ShardError, match=r"s\.vqtok: header must be a JSON object, got NoneType"):
        open_shard(p)


def test_shards_of_two_image_trees_are_refused(tmp_path):
    """A tree tokenized again without --flip left the old run's flip-* shards beside the new shard-* ones."""
    write_shard(tmp_path / "flip-0.vqtok", *_data(), dict(HEADER, flipped=True, files_sha256="aaaa"))
    write_shard(tmp_path / "shard-0.vqtok", *_data(), dict(HEADER, files_sha256="bbbb"))
    with pytest.raises(ShardError, match=r"different image trees: flip-0\.vqtok lists files aaaa, shard-0\.vqtok "
                                         r"lists bbbb"):
        TokenShardDataset(tmp_path)
    write_shard(tmp_path / "flip-0.vqtok", *_data(), dict(HEADER, flipped=True, files_sha256="bbbb"))
    assert len(TokenShardDataset(tmp_path)) == 20
    write_shard(tmp_path / "legacy.vqtok", *_data(), HEADER)  # from before the digest: not compared
    write_shard(tmp_path / "flip-1.vqtok", *_data(), dict(HEADER, flipped=True))
    assert len(TokenShardDataset(tmp_path)) == 40


def test_an_unfinished_flipped_set_is_refused(tmp_path):
    write_shard(tmp_path / "shard-0.vqtok", *_data(10), HEADER)
    write_shard(tmp_path / "shard-1.vqtok", *_data(10), HEADER)
    write_shard(tmp_path / "flip-0.vqtok", *_data(10), dict(HEADER, flipped=True))
    with pytest.raises(ShardError, match="10 flipped samples for 20 unflipped; an interrupted --flip run"):
        TokenShardDataset(tmp_path)


class _IndexTokenizer:  # token = the sample's index: the shards say which samples they hold
    identifier, codebook_size, grid = "index-tokenizer", 100, (1, 1)

    def encode(self, images):
        return images.reshape(len(images), -1)[:, :1].long()


def _batches(start, stop):
    yield torch.arange(start, stop, dtype=torch.float32)[:, None, None, None], torch.zeros(stop - start,
                                                                                            dtype=torch.long)


def test_a_rerun_with_another_shard_size_redoes_every_shard(tmp_path):
    """A shard records no range: after 4,4,2 a rerun at 2 kept the old last shard (samples 8, 9, two of
    them) as its shard 2 (samples 4, 5), losing two samples and duplicating two, every check passing."""
    from vqlcmd.data import TokenShardDataset
    from vqlcmd.data.writer import write_token_shards

    header = {"num_classes": 1, "class_names": ["x"]}
    logs = []
    for size in (4, 2):
        write_token_shards(tmp_path, _IndexTokenizer(), 10, _batches, header, shard_size=size, progress=False,
                           log=logs.append)
    tokens, _ = TokenShardDataset(tmp_path).gather(np.arange(10))
    assert tokens.reshape(-1).tolist() == list(range(10))
    assert "keeping 0 finished shard shard(s), making 5" in logs[-1] and "another shard size" in logs[-1]


# ---- the format's edges (labels under the CRC, uint16's whole range, empty shards, zero-sized grids, every
# index of a multi-shard set) -----------------------------------------------------------------------------
def _offsets(path):
    b, n = _raw(path)
    return b, 16 + n


def test_the_checksum_covers_the_labels_too(tmp_path):
    """The module docstring: "a CRC-32 of the arrays". A flipped bit in a label (still a valid class) must fail."""
    toks, labs = _data()
    p = write_shard(tmp_path / "s.vqtok", toks, labs, HEADER)
    s = open_shard(p)
    # independent reference: zlib over the little-endian uint16 tokens, then the int32 labels
    want = zlib.crc32(labs.astype("<i4").tobytes(), zlib.crc32(toks.reshape(10, 6).astype("<u2").tobytes()))
    assert s.header["crc32"] == want
    del s
    b, tok_off = _offsets(p)
    lab_off = tok_off + 128  # 10 x 6 uint16 = 120 bytes, padded to 64-byte alignment
    assert struct.unpack("<i", b[lab_off:lab_off + 4])[0] == labs[0]
    b = bytearray(b)
    b[lab_off] ^= 0x01  # label 0..3 -> another label in 0..3: the range check cannot see it
    p.write_bytes(bytes(b))
    with pytest.raises(ShardError, match=r"s\.vqtok: checksum mismatch"):
        open_shard(p)


def test_a_grid_side_of_zero_is_refused(tmp_path):
    with pytest.raises(ShardError, match=r"grid must be \[h, w\] of positive ints, got \[0, 3\]"):
        write_shard(tmp_path / "z.vqtok", np.zeros((2, 0, 3), np.int64), np.zeros(2, np.int64),
                    dict(HEADER, grid=[0, 3]))
    assert not (tmp_path / "z.vqtok").exists()


def test_a_codebook_of_65536_fills_uint16_exactly(tmp_path):
    """codebook_size <= 65536 (ids 0..65535 fit uint16): the largest codebook and its largest id round-trip."""
    toks = np.array([[0, 65535, 1, 2, 3, 65534]])
    p = write_shard(tmp_path / "k.vqtok", toks, np.zeros(1, np.int64), dict(HEADER, codebook_size=65536))
    assert open_shard(p).tokens.tolist() == toks.tolist()
    with pytest.raises(ShardError, match="does not fit uint16"):
        write_shard(tmp_path / "k2.vqtok", toks, np.zeros(1, np.int64), dict(HEADER, codebook_size=65537))


def test_an_empty_shard_opens_and_adds_nothing(tmp_path):
    """open_shard handles count 0 (no memory map of zero bytes); the header-length check must not refuse a file
    that ends right after its header."""
    p = write_shard(tmp_path / "a-empty.vqtok", np.zeros((0, 2, 3), np.int64), np.zeros(0, np.int64), HEADER)
    s = open_shard(p)
    assert len(s) == 0 and s.tokens.shape == (0, 6)
    toks, labs = _data(4)
    write_shard(tmp_path / "b.vqtok", toks, labs, HEADER)
    ds = TokenShardDataset(tmp_path)
    assert len(ds) == 4 and ds.gather([0, 3])[0].tolist() == [toks[0].reshape(-1).tolist(), toks[3].reshape(-1).tolist()]


def test_every_index_of_a_multi_shard_set_reads_its_own_sample(tmp_path):
    """ds[i] at shard boundaries (and negative i) against the concatenated source; i = len is an IndexError."""
    parts = [_data(n, seed) for n, seed in ((4, 1), (1, 2), (5, 3))]
    for k, (t, y) in enumerate(parts):
        write_shard(tmp_path / f"s-{k}.vqtok", t, y, HEADER)
    toks = np.concatenate([t.reshape(len(t), -1) for t, _ in parts])
    labs = np.concatenate([y for _, y in parts])
    ds = TokenShardDataset(tmp_path)
    n = len(ds)
    assert n == 10
    for i in range(-n, n):
        t, y = ds[i]
        assert t.tolist() == toks[i].tolist() and int(y) == labs[i], i
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]
    bt, by = ds.gather(np.arange(n))
    assert torch.equal(bt, torch.from_numpy(toks.astype(np.int64))) and by.tolist() == labs.tolist()


def test_a_rerun_with_more_samples_redoes_the_short_last_shard(tmp_path):
    """10 samples in shards of 4 end in a 2-sample shard 2; a rerun over 12 samples needs shard 2 to hold 8..11.
    Kept as finished, the set silently lacked samples 10 and 11."""
    from vqlcmd.data.writer import write_token_shards

    header = {"num_classes": 1, "class_names": ["x"]}
    write_token_shards(tmp_path, _IndexTokenizer(), 10, _batches, header, shard_size=4, progress=False,
                       log=lambda *a: None)
    stats = write_token_shards(tmp_path, _IndexTokenizer(), 12, _batches, header, shard_size=4, progress=False,
                               log=lambda *a: None)
    assert stats["written"] == 1
    tokens, _ = TokenShardDataset(tmp_path).gather(np.arange(12))
    assert tokens.reshape(-1).tolist() == list(range(12))


def test_a_finished_single_short_shard_is_kept_on_rerun(tmp_path):
    """The module promise: a rerun only makes the missing shards. One shard shorter than shard_size (count <
    shard_size) is finished work, not 'another shard size'."""
    from vqlcmd.data.writer import write_token_shards

    header = {"num_classes": 1, "class_names": ["x"]}
    logs = []
    write_token_shards(tmp_path, _IndexTokenizer(), 3, _batches, header, shard_size=10, progress=False,
                       log=logs.append)
    stamp = (tmp_path / "shard-00000.vqtok").stat().st_mtime_ns
    stats = write_token_shards(tmp_path, _IndexTokenizer(), 3, _batches, header, shard_size=10, progress=False,
                               log=logs.append)
    assert stats["written"] == 0 and (tmp_path / "shard-00000.vqtok").stat().st_mtime_ns == stamp
    assert "keeping 1 finished" in logs[-1] and "another shard size" not in logs[-1]


def test_own_prefix_shards_of_the_other_flip_are_another_data_set(tmp_path):
    """write_token_shards: shards of another data set are an error naming the difference, not silently replaced;
    `flipped` is skipped only for the other prefix's shards (flip-* beside shard-*)."""
    from vqlcmd.data.writer import write_token_shards

    header = {"num_classes": 1, "class_names": ["x"]}
    quiet = dict(shard_size=4, progress=False, log=lambda *a: None)
    write_token_shards(tmp_path, _IndexTokenizer(), 4, _batches, dict(header, flipped=True), **quiet)
    before = (tmp_path / "shard-00000.vqtok").read_bytes()
    with pytest.raises(ShardError, match=r"1 shard\(s\) of another data set \(shard-00000\.vqtok: flipped true, not false"):
        write_token_shards(tmp_path, _IndexTokenizer(), 4, _batches, dict(header, flipped=False), **quiet)
    assert (tmp_path / "shard-00000.vqtok").read_bytes() == before
    # the other prefix's flipped shards are this data set's
    write_token_shards(tmp_path, _IndexTokenizer(), 4, _batches, dict(header, flipped=False), prefix="flip", **quiet)
