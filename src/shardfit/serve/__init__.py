"""`shardfit serve`: the Tinker API (the official `tinker` SDK's protocol) in front of the Engine.

Rank 0 runs the HTTP server (app.py, routes.py) and checks every request before it becomes a command; every rank
runs the command loop (commands.py), which executes each command on the Engine (executor.py, sampling.py) in the
same order, and turns whatever a command raises into that request's answer (commands.failure_result). Wire formats:
protocol.py; futures and long polls: futures.py; seq_id order: ordering.py; keys, principals and paths:
security.py; the REST listings: listings.py; frozen extra models (--serve.models): served.py. The protocol's spec
is the SDK's own source (tinker 0.38.0, Apache-2.0): lib/public_interfaces/ and proto/.
"""
