"""Training-time updates of the residual VQ codebooks: k-means init, EMA, dead-code restart."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tts.codec import ResidualVQ


def _nearest(x: torch.Tensor, book: torch.Tensor) -> torch.Tensor:  # x (N, D), book (C, D) -> (N,)
    return (x.pow(2).sum(-1, keepdim=True) - 2 * x @ book.T + book.pow(2).sum(-1)).argmin(-1)


def kmeans(x: torch.Tensor, k: int, iters: int = 10) -> torch.Tensor:
    centers = x[torch.randperm(len(x), device=x.device)[:k]].clone()
    for _ in range(iters):
        index = _nearest(x, centers)
        sums = torch.zeros_like(centers).index_add_(0, index, x)
        counts = torch.bincount(index, minlength=k).float()[:, None]
        centers = torch.where(counts > 0, sums / counts.clamp(min=1), centers)
    return centers


class EMAQuantizerTrainer:
    """Quantises (B, D, T) latents with the first ``n_q`` codebooks of ``rvq`` and updates those
    codebooks by exponential moving average. Returns the straight-through quantised latents and the
    commitment loss. ``frozen``: keep trained codebooks as they are (no k-means, no EMA), so a token
    keeps its codeword while the encoder learns to choose better ones."""

    def __init__(self, rvq: ResidualVQ, decay: float = 0.99, dead_threshold: float = 2.0, frozen: bool = False):
        self.rvq, self.decay, self.dead_threshold, self.frozen = rvq, decay, dead_threshold, frozen
        books = rvq.codebooks
        self.cluster_size = torch.ones(books.shape[:2], device=books.device)
        self.embed_sum = books.clone()
        self.initialised = frozen

    @torch.no_grad()
    def _update(self, k: int, x: torch.Tensor, index: torch.Tensor) -> None:
        size = books_size = self.rvq.codebooks.shape[1]
        counts = torch.bincount(index, minlength=books_size).float()
        sums = torch.zeros_like(self.embed_sum[k]).index_add_(0, index, x)
        self.cluster_size[k].mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embed_sum[k].mul_(self.decay).add_(sums, alpha=1 - self.decay)
        n = self.cluster_size[k].sum()
        smoothed = (self.cluster_size[k] + 1e-5) / (n + size * 1e-5) * n
        self.rvq.codebooks[k] = self.embed_sum[k] / smoothed[:, None]
        dead = self.cluster_size[k] < self.dead_threshold
        if dead.any():
            fresh = x[torch.randint(len(x), (int(dead.sum()),), device=x.device)]
            self.rvq.codebooks[k][dead] = fresh
            self.embed_sum[k][dead] = fresh * self.dead_threshold
            self.cluster_size[k][dead] = self.dead_threshold

    def __call__(self, z: torch.Tensor, n_q: int, training: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        flat = z.float().transpose(1, 2).reshape(-1, z.shape[1])  # (B*T, D)
        if training and not self.initialised:
            residual = flat.detach()
            for k in range(self.rvq.codebooks.shape[0]):
                self.rvq.codebooks[k] = kmeans(residual, self.rvq.codebooks.shape[1])
                self.embed_sum[k] = self.rvq.codebooks[k].clone()
                residual = residual - self.rvq.codebooks[k][_nearest(residual, self.rvq.codebooks[k])]
            self.initialised = True
        residual, quantized = flat.detach(), torch.zeros_like(flat)
        for k in range(n_q):
            index = _nearest(residual, self.rvq.codebooks[k])
            if training and not self.frozen:
                self._update(k, residual, index)
            chosen = self.rvq.codebooks[k][index]
            quantized = quantized + chosen
            residual = residual - chosen
        commit = F.mse_loss(flat, quantized.detach())
        out = flat + (quantized - flat).detach()
        return out.reshape(z.shape[0], z.shape[2], -1).transpose(1, 2), commit
