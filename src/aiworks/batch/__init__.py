"""Batch jobs, the offline tier (docs/tiers.md): JSONL files of OIP requests scored through the gateway.

- :mod:`aiworks.batch.lines`: one input line to a request, or to the reason it is refused;
- :mod:`aiworks.batch.objects`: reading and writing local paths and ``s3://`` objects;
- :mod:`aiworks.batch.jobs`: the job record, its chunks and the checkpoints, in Redis;
- :mod:`aiworks.batch.runner`: the process that runs jobs, a client of the gateway's public API;
- :mod:`aiworks.batch.job_files`, :mod:`aiworks.batch.answers`: the runner's files and its answers made into lines.
"""
