"""The console's pages and JSON endpoints, one module per subject. Short function views: fetch, check the role, call an
action or a read model, render. Rules, audits and state changes live in the actions (recovery.actions)."""
