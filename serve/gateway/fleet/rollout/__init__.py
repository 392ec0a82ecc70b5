"""Promotions: a new fine-tune put in front of an old one while the gateway serves, with no request lost.

- store.py: what the gateway changed at run time (routes, the models a promotion retired, the promotions themselves),
  kept in one JSON file (`rollout_file`) that every worker reads and the next start finds;
- table.py: each worker's live view of it (the routes a request is drawn through, which models are watched, shadowed
  or pinned) and the promotion's steps (started, shadow, canary, switched, done; rolled back or interrupted);
- shadow.py: a share of the current model's requests sent again to the candidate, its answers compared and dropped.

`rtxserve promote` (rtxserve/promote/) drives the steps through the admin routes (admin/promotions.py); the gateway
keeps the state consistent on its own: a promotion whose driver stops renewing its lease, or that a restart finds
before its switch, is rolled back; one found switched is finished.
"""
