"""The hand-written text of the corpus study's report (framing, definitions, limits); every
number is filled in from results.json by `experiments.corpus_study.report`."""

TITLE = "Corpus study on k3-mini: what a calibration set keeps and loses"
INTRO = """Reproduce: `python -m experiments.corpus_study` from the repository root (one command,
fixed seeds, resumable; work files in `/tmp/corpus-study`), which writes
`reports/corpus-study/results.json` (summaries), `builds.json` (every build's record) and this
report with its plots. Every number below is read from those files by
`python -m experiments.corpus_study.report`."""
SUMMARY_INTRO = """The findings reported by the pruning study behind the K3 350 GB build, tested on
k3-mini. Perplexity effects are shown as ratios of perplexities between the two builds (1.00 =
no difference), overlap and generation effects as differences; mean [95 % interval over
calibration seeds]. Generation and overlap effects are measured once (first budget's generations;
top-m sets of the calibration statistics), so they fill the first column only."""
ANSWERS_INTRO = """Each effect is computed per calibration seed and summarized as mean [95 % Student-t
interval over the seeds]. Perplexity effects are differences of log(perplexity / full model)
between two builds at the same budget on the same eval documents; the "as a ppl ratio" column is
its exponential (e.g. 1.30 = 30 % higher perplexity than the other build). A verdict **holds** when
the interval excludes zero in the predicted direction, **reversed** when it excludes zero in the
other, **inconclusive** otherwise; rows marked n/a are reported without a prediction."""
OVERLAP_INTRO = """Each corpus's important experts in a layer are its top-{m} by routed token count
(the size of the K3-share build); the Jaccard index of two corpora's sets, averaged over the MoE
layers and the seeds, is divided by the exact expectation for random sets of the same sizes
(hypergeometric null, `reap.analyze.chance`). Above 1: more shared experts than chance."""
QUALITY_INTRO = """Perplexity of each build divided by the full model's on held-out eval documents of
each domain: geometric mean over seeds [95 % t-interval over seeds of the log ratio,
exponentiated]. `eu` is de+fr+es+it."""
GEN_INTRO = """Greedy continuations of the shipped prompts ({n} tokens) by the full model and by the
REAP builds at the first budget, measured by `reap.eval.text_metrics` in text units (a CJK character,
a word or a run of one punctuation mark): `looping` = share of outputs that end in repeated
copies of one block (greedy degeneration), `longest_repeat` = longest n-gram of units occurring
twice, `distinct_2` = share of distinct unit bigrams, `script` = share of letters in the
domain's script, `python_valid` = prompt + continuation parses with `ast` (also without the last,
possibly cut, line). Mean over seeds [t-interval]."""
CRIT_INTRO = """Builds from the same `{s}` statistics at the same budget, chosen by REAP (mean gate
weight x expert output norm), frequency (share of routed tokens), EAN (mean output norm), recon
(the set minimising each layer's routed output error, below) or at random (a different random
draw per seed); super-expert protection was on for all of them
({p} experts protected over all builds). Quality is the mean over the five domains of
log(perplexity / full model)."""
METHOD = """- Model: `{model}` (fingerprint {fp}), code {code}.
- Calibration: {seeds} seeds; per seed one run over zh, en, de, fr, es, it, ja and code with
  {seqs} sequences x {seq_len} tokens = {tok} tokens per corpus (calibration split). Per-corpus
  statistics are assembled into the calibration sets: {sets}; `eu` is the exact merge of the four
  languages' statistics (so it pools four times the tokens of a single corpus).
- Budgets: {budgets}; uniform over the MoE layers; REAP criterion unless stated.
- Evaluation (`reap.eval.evaluate`, float32, CPU): the first {docs} eval documents per domain in the
  fixed document order, {dtok} tokens each; {boot} bootstrap replicates over documents; greedy
  generations of {gen} tokens on the {gd} prompt sets (16 prompts each).
- Compute: {minutes:.1f} minutes of build time (pruning + evaluation) in the run that wrote the
  results (cached builds count the time of their first run)."""
LIMITS = """- k3-mini has 6 M parameters and was trained on 5 M tokens: its perplexities are high, and its
  greedy generations repeat themselves even unpruned, so repetition effects are small changes on a
  high baseline. Expert specialization in a model this small need not match Kimi K3's.
- k3-mini was trained with loss-free load balancing (the router bias moves every expert toward
  equal load), which may spread domains over experts more evenly than a large model's training
  does; that it also shows near-random pruning quality is consistent with weakly specialized
  experts, not proof of it.
- 64 experts per layer and 5 MoE layers: a top-m set holds 10-32 experts, so overlap estimates
  are coarse; the chance level is exact, but layers are treated as independent.
- Three calibration seeds give wide Student-t intervals (t = 4.30 for 2 degrees of freedom): an
  "inconclusive" verdict can hide a real but small effect. Document-level intervals are per seed.
- Calibration sets are assembled from per-corpus statistics of one mixed run per seed (checked
  equal to a separate run for `en+code`); each set's corpora get equal weight in the plan.
- The eval documents (a few thousand tokens per domain) are held out from training and
  calibration, but come from the same sources as the training data.
- The predicted damage is the REAP mass a plan drops; its interval resamples calibration
  sequences' routing counts (the statistics hold no per-sequence REAP sums), so it says how
  stable the prediction is, not how far the measured loss may fall from it. At these budgets
  almost no token keeps its whole top-6, so that share cannot rank builds here.
- recon's objective is the exact change of each MoE layer's output on the calibration tokens
  (the per-token Gram of expert contributions, and the rescale of k3-mini's RMS-normalised
  routed sum) when each token keeps its surviving top-k experts with renormalised weights; the
  pruned model instead routes substitutes in, and the layers' errors compound through the
  model, so a lower objective need not mean a lower perplexity."""
