"""The live loss dashboard: `andrea dashboard` serves a page that follows NAME.loss.json files as
training appends to them. The server (server.py) is read-only and standard-library only; the page
(static/) is plain JS over a vendored uPlot and also opens without the server (docs/DASHBOARD.md).
Nothing here imports an engine."""
