"""`python -m experiments.corpus_study`: run the corpus study (options: `--help`)."""

import sys

from experiments.corpus_study.study import main

sys.exit(main())
