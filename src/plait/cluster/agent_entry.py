"""``python -m plait.cluster.agent_entry ARGS``: the node agent (`plait.cluster.agent`) run.

A module of its own because ``plait.cluster`` imports `plait.cluster.agent` (the launcher
reads its constants): run as ``-m plait.cluster.agent``, the module would be executed a
second time beside the imported copy, and Python warns about it on every node.
"""

from plait.cluster.agent import main

if __name__ == "__main__":
    main()
