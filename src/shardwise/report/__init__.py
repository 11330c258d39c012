"""What the commands print: one payload builder per command (`builders`, shared by the CLI's
`--json` and the web API), terminal renderings of those payloads (`text`) and the planner's
report (`plan_report`)."""
