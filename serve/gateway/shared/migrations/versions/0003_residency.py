"""One decider for on-demand models over several gateways (fleet/decider.py): what it decided per model, each
gateway's beat (what its requests wait for and hold), and the leases (the decider's).

Revision ID: 0003
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0003", "0002"


def upgrade() -> None:
    op.create_table("residency", sa.Column("model", sa.Text, primary_key=True),
                    sa.Column("state", sa.Text, nullable=False), sa.Column("epoch", sa.BigInteger, nullable=False),
                    sa.Column("changed_at", sa.Float, nullable=False), sa.Column("why", sa.Text),
                    sa.Column("retry_at", sa.Float))
    op.create_table("gateways", sa.Column("name", sa.Text, primary_key=True),
                    sa.Column("beat_at", sa.Float, nullable=False), sa.Column("seen", sa.BigInteger, nullable=False),
                    sa.Column("in_flight", sa.JSON, nullable=False), sa.Column("last_used", sa.JSON, nullable=False),
                    sa.Column("wanted", sa.JSON, nullable=False))
    op.create_table("leases", sa.Column("name", sa.Text, primary_key=True), sa.Column("holder", sa.Text, nullable=False),
                    sa.Column("until", sa.Float, nullable=False))
