-- A critical rule may require several distinct approvers; each approval is a vote until the
-- request's quorum is reached. One vote per approver per plan.
ALTER TABLE approvals ADD COLUMN quorum integer NOT NULL DEFAULT 1;
CREATE TABLE approval_votes (
    run_id    uuid        NOT NULL,
    plan_hash text        NOT NULL,
    approver  text        NOT NULL,
    channel   text        NOT NULL,
    voted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, plan_hash, approver)
);
