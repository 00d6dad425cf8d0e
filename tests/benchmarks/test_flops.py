"""benchmarks/flops.py against a count by hand, from the architecture in docs/method.md (§12, §7-8)."""
import pytest

from benchmarks import flops
from vqlcmd.model import Denoiser, DenoiserConfig

# a tiny denoiser: K = 16 codes, D = 8, M = 16 tokens, W = 32, L = 2 blocks, MLP hidden 4W = 128, 32 time features
K, D, M, W, L, HIDDEN, F = 16, 8, 16, 32, 2, 128, 32
CFG = DenoiserConfig(codebook_size=K, embed_dim=D, seq_len=M, num_classes=4, width=W, depth=L, heads=2,
                     mlp_ratio=4.0, time_features=F)

# weights applied per token: in_proj D·W = 256; per block qkv 3·W² = 3072, proj W² = 1024, MLP 2·W·HIDDEN = 8192
# (12288 a block, 24576 for both); head W·K = 512
P_TOK = 256 + 24576 + 512  # 25344
# weights applied once per sequence: time MLP F·W + W·W = 2048; an AdaLN's to_ab W·2W = 2048, two per block
# and the final one, 5 in all = 10240 (the class embedding is a lookup: no multiply-adds)
P_SEQ = 2048 + 10240  # 12288
# one forward of one sequence: 2 FLOPs per weight and token, 2 per weight and sequence, and attention's
# QKᵀ and PV, 2·M²·W each per block: 2·25344·16 + 2·12288 + 2·2·(2·16²·32) = 811008 + 24576 + 65536
F_FWD = 901120


def test_the_forward_count_is_the_hand_count():
    den = Denoiser(CFG)
    assert flops.denoiser_weights(den) == (P_TOK, P_SEQ)
    assert flops.denoiser_forward_flops(den, M) == F_FWD


@pytest.mark.parametrize("batch, l0_fraction, teacher, expected", [
    # B = 8, l0_fraction 1/4: B0 = 2 L0 rows. Student fwd+bwd 3·(8 + 2)·901120 = 27033600; teacher fwd
    # 8·901120 = 7208960; Ψ̂ fwd+bwd 6·8·16·16·8 = 98304
    (8, 0.25, True, 27033600 + 7208960 + 98304),
    # l0_fraction 1: B0 = B = 8, 3·16·901120 = 43253760
    (8, 1.0, True, 43253760 + 7208960 + 98304),
    # B0 rounds up and is at least one: ceil(0.1·8) = 1 -> 3·9·901120 = 24330240
    (8, 0.1, True, 24330240 + 7208960 + 98304),
    # without L_CM (β_CM = 0) no teacher forward runs
    (8, 0.25, False, 27033600 + 98304),
])
def test_the_step_count_is_the_hand_count(batch, l0_fraction, teacher, expected):
    den = Denoiser(CFG)
    assert flops.train_step_flops(den, batch, M, l0_fraction=l0_fraction, teacher=teacher) == expected
