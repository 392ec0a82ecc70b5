"""Each gateway's beat says which on-demand models a promotion retired through it (fleet/decider.py): the decider
unloads them once nothing runs on them, whichever gateway heard of the retirement.

Revision ID: 0004
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0004", "0003"


def upgrade() -> None:
    op.add_column("gateways", sa.Column("retired", sa.JSON, nullable=False, server_default="[]"))
