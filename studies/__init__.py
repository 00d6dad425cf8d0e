"""Study drivers: the experiments behind docs/reproduce.md and docs/quickstart.md, run from the repository root.

    python -m studies.reproduce --quick           # the paper's comparison tables at small scale
    python -m studies.sampling_sweep PIPELINE --out sweep.jsonl
    python -m studies.digits_table --pipeline PIPELINE
    python -m studies.collapse_study              # embedding collapse with and without L_CM
    python -m studies.paper_steps STUDY_DIR       # a finished study's pipelines at the paper's step counts
    python -m studies.maskgit_omega0 PIPELINE OUT.jsonl

They use the installed ``vqlcmd`` package and are not part of it: they are not installed with it.
"""
