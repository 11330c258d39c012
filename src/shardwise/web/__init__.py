"""The web app behind `shardwise ui`: a FastAPI application (`app.create_app`).

`/api/*` answers with exactly what the CLI's `--json` prints for the same input (one builder per
command in `shardwise.report`); `/api/learn/*` serves the explainers' data from the emulations
and the analytic models. The front end in `static/` is plain HTML/CSS/ES modules shipped in
the package: no CDN, no build step.
"""
