"""``make check``: a vLLM change (a checkout, a wheel, a release) against its base, in one table.

Both sides run the same suites, each under its own overlay (``vllm_source``) with every mode
``upstream``: nothing of the testbed's replaces vLLM's code, so a known failure is a plain failure
and the comparison, not the strict expectations table (``known.py``, the project's CI), decides.
Per property and path the table gives the base's outcome, the candidate's and a verdict:

- FIXED: the base failed (its known failure: the finding is named), the candidate passes;
- BROKE: the base passed and the candidate fails, or fails differently from the base's known
  failure (the failing check's message and evidence quoted), or hangs;
- STILL-FAILING: the base's known failure, still there;
- SAME: both pass (or both skip).

Then speed: a broadcast micro-benchmark, base and candidate taking turns round by round in one
run, candidate / base with its interval beside the machine's noise (A/A). Modules by job:
``resolve`` (which candidate and base), ``suites`` (which tests, their property and path),
``side`` (run one side's suites, bounded), ``compare`` (verdicts), ``speed`` (the interleaved
benchmark, ``speed_child`` its per-side process), ``e2e`` (the e2e smoke per side), ``report``
(terminal table, check.json, check.md, junit.xml).
"""
