"""`aiworks bench`: a closed-loop load generator in the spirit of perf_analyzer."""
