"""A compact re-statement of taming-transformers' VQGAN (taming/modules/diffusionmodules/model.py and
vqvae/quantize.py): same module names, so same state-dict keys and shapes, and the same forward
math. The converter test builds checkpoints from it and checks that the converted diffusers
model computes the same tokens and images."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def Normalize(c):
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


def swish(x):
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1, self.conv1 = Normalize(cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.dropout, self.conv2 = Normalize(cout), nn.Dropout(0.0), nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)
        self.cin, self.cout = cin, cout

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        return (self.nin_shortcut(x) if self.cin != self.cout else x) + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = Normalize(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        q = q.reshape(b, c, hh * ww).permute(0, 2, 1)
        w = torch.bmm(q, k.reshape(b, c, hh * ww)) * (int(c) ** -0.5)
        w = F.softmax(w, dim=2)
        h = torch.bmm(v.reshape(b, c, hh * ww), w.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + self.proj_out(h)


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Mid(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)

    def forward(self, x):
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, attn_resolutions, in_channels, resolution, z_channels, **_):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, 1, 1)
        self.down = nn.ModuleList()
        cur, in_mult = resolution, (1,) + tuple(ch_mult)
        for i, m in enumerate(ch_mult):
            level, bin_, bout = nn.Module(), ch * in_mult[i], ch * m
            level.block, level.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                level.block.append(ResnetBlock(bin_, bout))
                bin_ = bout
                if cur in attn_resolutions:
                    level.attn.append(AttnBlock(bout))
            if i != len(ch_mult) - 1:
                level.downsample = Downsample(bout)
                cur //= 2
            self.down.append(level)
        self.mid = Mid(bout)
        self.norm_out, self.conv_out = Normalize(bout), nn.Conv2d(bout, z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(swish(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, ch, out_ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, **_):
        super().__init__()
        n = len(ch_mult)
        bin_ = ch * ch_mult[-1]
        cur = resolution // 2 ** (n - 1)
        self.conv_in = nn.Conv2d(z_channels, bin_, 3, 1, 1)
        self.mid = Mid(bin_)
        self.up = nn.ModuleList()
        for i in reversed(range(n)):
            level, bout = nn.Module(), ch * ch_mult[i]
            level.block, level.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                level.block.append(ResnetBlock(bin_, bout))
                bin_ = bout
                if cur in attn_resolutions:
                    level.attn.append(AttnBlock(bout))
            if i != 0:
                level.upsample = Upsample(bout)
                cur *= 2
            self.up.insert(0, level)  # as taming does: up[0] is the highest resolution
        self.norm_out, self.conv_out = Normalize(bout), nn.Conv2d(bout, out_ch, 3, 1, 1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for i in reversed(range(len(self.up))):
            level = self.up[i]
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[j](h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, n_e, e_dim):
        super().__init__()
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight.data.uniform_(-1.0 / n_e, 1.0 / n_e)

    def indices(self, z):
        zf = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        e = self.embedding.weight
        d = (zf ** 2).sum(1, keepdim=True) + (e ** 2).sum(1) - 2 * zf @ e.t()
        return d.argmin(1).reshape(z.shape[0], z.shape[2], z.shape[3])


class TamingVQModel(nn.Module):
    """taming.models.vqgan.VQModel without the training loss module (the test adds ``loss.*`` keys)."""

    def __init__(self, cfg):
        super().__init__()
        self.encoder, self.decoder = Encoder(**cfg), Decoder(**cfg)
        self.quantize = VectorQuantizer(cfg["n_embed"], cfg["embed_dim"])
        self.quant_conv = nn.Conv2d(cfg["z_channels"], cfg["embed_dim"], 1)
        self.post_quant_conv = nn.Conv2d(cfg["embed_dim"], cfg["z_channels"], 1)

    def encode_ids(self, x):
        return self.quantize.indices(self.quant_conv(self.encoder(x)))

    def decode_ids(self, ids):
        q = self.quantize.embedding(ids).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(q))


def fake_loss_tensors():
    """A few ``loss.*`` tensors with the real names (NLayerDiscriminator + LPIPS) to prove they are dropped."""
    return {"loss.logvar": torch.zeros(()),
            "loss.perceptual_loss.net.slice1.0.weight": torch.randn(64, 3, 3, 3),
            "loss.perceptual_loss.lin0.model.1.weight": torch.randn(1, 64, 1, 1),
            "loss.discriminator.main.0.weight": torch.randn(64, 3, 4, 4),
            "loss.discriminator.main.0.bias": torch.randn(64)}

