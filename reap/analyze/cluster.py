"""Clusters: corpora by usage, experts by their per-corpus profile, co-activation communities.

- Corpora: average-linkage clustering of the Jensen-Shannon distance between their routing
  distributions, averaged over layers.
- Experts: each (layer, expert) used enough is a point whose coordinates are its corpus shares;
  k-means with k chosen by the silhouette score.
- Co-activation: per layer, the graph whose edge weight is how many tokens routed to both
  experts. Modularity compares each edge with the co-occurrence expected from the experts' own
  loads (the configuration model), so communities are groups that co-fire more than their loads
  predict (greedy Clauset-Newman-Moore). Its chance baseline: the same algorithm on Poisson
  co-occurrences at the expected rates, since greedy search finds some modularity in pure noise.

Dimension letters: C corpora, L layers, E experts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from reap.analyze.overlap import CorpusUsage, jsd
from reap.analyze.specialists import ExpertProfiles, Shuffled


@dataclass
class CorpusClustering:
    """Hierarchical clustering of corpora by routing similarity."""

    corpora: list[str]  # [C]
    distance: np.ndarray  # [C, C] mean over layers of the Jensen-Shannon distance
    linkage: np.ndarray  # [C-1, 4] scipy linkage matrix (average linkage)
    order: list[str]  # leaf order of the dendrogram


def cluster_corpora(corpora: list[CorpusUsage]) -> CorpusClustering:
    """Average-linkage clustering of corpora on the mean Jensen-Shannon distance."""
    from scipy.cluster.hierarchy import leaves_list, linkage
    from scipy.spatial.distance import squareform

    u = np.stack([c.usage() for c in corpora])  # [C, L, E]
    C = len(corpora)
    d = np.zeros((C, C))
    for i, j in itertools.combinations(range(C), 2):
        d[i, j] = d[j, i] = float(np.sqrt(jsd(u[i], u[j])).mean())
    z = linkage(squareform(d, checks=False), method="average")
    names = [c.name for c in corpora]
    return CorpusClustering(names, d, z, [names[i] for i in leaves_list(z)])


@dataclass
class ExpertClustering:
    """k-means clusters of experts by their corpus shares."""

    corpora: list[str]  # [C] feature order
    k: int  # chosen by silhouette
    silhouette: dict[int, float]  # k -> mean silhouette score tried
    labels: np.ndarray  # [L, E] cluster of each expert, -1 = too rarely used to place
    centroids: np.ndarray  # [k, C] mean corpus shares of each cluster
    points: np.ndarray  # [n, C] the clustered shares (experts with labels >= 0, row-major)
    null_silhouette: list[float]  # best silhouette of the same search on shuffled sequences
    dispersion: float  # mean distance of the profiles from an even split (see profile_dispersion)
    null_dispersion: list[float]  # the same on every sequence shuffle

    @property
    def best(self) -> float:
        return self.silhouette[self.k]


def _used_shares(freq: np.ndarray, min_load: float) -> tuple[np.ndarray, np.ndarray]:
    """Mask of experts used enough [L, E] and their corpus shares [n, C], from rates [L, E, C]."""
    E, C = freq.shape[1:]
    top_k = freq[0].sum() / C  # each corpus's rates of a layer sum to top_k
    used = freq.mean(-1) >= min_load * top_k / E  # [L, E]
    x = freq[used]
    return used, x / x.sum(-1, keepdims=True)


def profile_dispersion(shares: np.ndarray) -> float:
    """How corpus-specific experts are: mean total-variation distance of their share vectors
    [n, C] from the even split 1/C (0 = every expert used alike by all corpora)."""
    C = shares.shape[-1]
    return float(0.5 * np.abs(shares - 1.0 / C).sum(-1).mean()) if len(shares) else float("nan")


def _sweep(x: np.ndarray, k_max: int, seed: int, sample: int) -> tuple[dict, dict]:
    """k-means for k = 2..k_max: (k -> silhouette, k -> fitted model)."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    scores, models = {}, {}
    if len(np.unique(x.round(12), axis=0)) < 3:
        return scores, models
    for k in (k for k in range(2, k_max + 1) if k < len(x)):
        km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x)
        if len(np.unique(km.labels_)) < 2:
            continue
        n = min(sample, len(x))
        scores[k] = float(silhouette_score(x, km.labels_, sample_size=n, random_state=seed))
        models[k] = km
    return scores, models


def cluster_experts(
    profiles: ExpertProfiles,
    k_max: int = 8,
    seed: int = 0,
    sample: int = 4000,
    null: Shuffled | None = None,
    n_null: int = 10,
) -> ExpertClustering | None:
    """Cluster used experts (mean usage rate at least `min_load` times uniform) by share profile;
    None when too few distinct points. Chance levels from sequence shuffles: the same search on
    the first `n_null` shuffles, since k-means finds "clusters" in noise too, and the profile
    dispersion on every shuffle (are experts corpus-specific at all?).
    """
    used, x = _used_shares(profiles.freq, profiles.min_load)
    scores, models = _sweep(x, k_max, seed, sample)
    if not scores:
        return None
    best = max(scores, key=lambda k: (scores[k], -k))
    labels = np.full(used.shape, -1)
    labels[used] = models[best].labels_
    null_best, null_disp = [], []
    for p in range(0 if null is None else len(null)):
        xp = _used_shares(null.freq(p), profiles.min_load)[1]
        null_disp.append(profile_dispersion(xp))
        if p < n_null:
            s, _ = _sweep(xp, k_max, seed, sample)
            null_best.append(max(s.values(), default=float("nan")))
    return ExpertClustering(
        profiles.corpora, best, scores, labels, models[best].cluster_centers_, x, null_best,
        profile_dispersion(x), null_disp,
    )  # fmt: skip


def _without_self_loops(w: np.ndarray) -> np.ndarray:
    """A float64 copy of the graph's weights [E, E] with the diagonal zeroed."""
    w = np.array(w, dtype=np.float64)
    np.fill_diagonal(w, 0.0)
    return w


def modularity(w: np.ndarray, labels: np.ndarray) -> float:
    """Newman modularity of a partition of a weighted undirected graph (diagonal ignored)."""
    w = _without_self_loops(w)
    total = w.sum()
    if total <= 0:
        return 0.0
    deg = w.sum(1)
    same = labels[:, None] == labels[None, :]
    return float(((w - np.outer(deg, deg) / total) * same).sum() / total)


def greedy_modularity(w: np.ndarray) -> tuple[np.ndarray, float]:
    """Clauset-Newman-Moore greedy modularity communities of a weighted graph.

    w: [E, E] symmetric non-negative weights (diagonal ignored). Repeatedly merges the two
    communities whose merge raises modularity most, until no merge helps. Returns (labels [E],
    numbered by decreasing community size, modularity).
    """
    w = _without_self_loops(w)
    n, total = len(w), w.sum()
    if total <= 0:
        return np.arange(n), 0.0
    e = w / total  # [E, E] fraction of edge ends between communities i and j
    a = e.sum(1)  # [E] fraction of edge ends in community i
    dq = 2 * (e - np.outer(a, a))  # modularity gain of merging i and j
    np.fill_diagonal(dq, -np.inf)
    owner, alive = np.arange(n), np.ones(n, dtype=bool)
    q = float(np.trace(e) - (a * a).sum())
    while True:
        flat = int(np.argmax(dq))
        i, j = divmod(flat, n)
        gain = dq[i, j]
        if not gain > 1e-12:
            break
        e[i, :] += e[j, :]
        e[:, i] += e[:, j]
        a[i] += a[j]
        e[j, :] = e[:, j] = a[j] = 0.0
        owner[owner == j] = i
        alive[j] = False
        q += gain
        row = np.where(alive, 2 * (e[i] - a[i] * a), -np.inf)
        dq[i, :], dq[:, i] = row, row
        dq[j, :] = dq[:, j] = -np.inf
        dq[i, i] = -np.inf
    return _relabel(owner), q


def _relabel(owner: np.ndarray) -> np.ndarray:
    ids, inv, sizes = np.unique(owner, return_inverse=True, return_counts=True)
    rank = np.empty(len(ids), dtype=np.int64)
    rank[np.lexsort((ids, -sizes))] = np.arange(len(ids))
    return rank[inv]


@dataclass
class Communities:
    """Co-activation communities of one layer, pooled over corpora."""

    layer: int  # model layer index
    labels: np.ndarray  # [E] community of each expert (0 = largest)
    modularity: float
    null: list[float]  # Q of the same search on Poisson graphs of expected co-occurrences
    share: np.ndarray  # [G, C] each community's usage split over corpora (rows sum to 1)

    @property
    def n_communities(self) -> int:
        return int(self.labels.max()) + 1

    @property
    def null_mean(self) -> float:
        return float(np.mean(self.null)) if self.null else float("nan")

    @property
    def null_max(self) -> float:
        return float(np.max(self.null)) if self.null else float("nan")


def expected_coact_graph(w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random graph with each edge Poisson at its configuration-model rate d_i d_j / 2W."""
    w = _without_self_loops(w)
    deg = w.sum(1)
    rate = np.outer(deg, deg) / max(deg.sum(), 1e-300)  # [E, E]
    g = np.triu(rng.poisson(rate).astype(np.float64), 1)
    return g + g.T


def layer_communities(
    corpora: list[CorpusUsage], li: int, rng: np.random.Generator, n_null: int = 3
) -> Communities:
    """Communities of layer row li of the pooled co-activation graph, with `n_null` chance Qs."""
    w = sum(c.stats.coact[li].double().numpy() for c in corpora)  # [E, E]
    labels, q = greedy_modularity(w)
    null = [greedy_modularity(expected_coact_graph(w, rng))[1] for _ in range(n_null)]
    freq = np.stack([c.count[li] / c.tokens for c in corpora], -1)  # [E, C]
    use = np.stack([freq[labels == g].sum(0) for g in range(labels.max() + 1)])  # [G, C]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = use / use.sum(-1, keepdims=True)
    return Communities(corpora[0].stats.layers[li], labels, q, null, share)


def communities(
    corpora: list[CorpusUsage], seed: int = 0, n_null: int = 3, progress: bool = False
) -> list[Communities]:
    """Co-activation communities of every layer (progress bar over layers)."""
    from tqdm.auto import tqdm

    rng = np.random.default_rng(seed)
    L = len(corpora[0].stats.layers)
    return [
        layer_communities(corpora, li, rng, n_null)
        for li in tqdm(range(L), desc="communities", disable=not progress)
    ]
