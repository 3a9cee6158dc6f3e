-- Where each approval request was posted: a bridge's consumer and the request's attempt
-- (`slack-bridge:2`), added once the chat said ok. A request delivered to the bridge again (an
-- ack lost, a consumer made anew, the request published twice) is not posted twice. A few
-- entries a request: one a bridge an attempt.
ALTER TABLE approvals ADD COLUMN IF NOT EXISTS posted_to text[] NOT NULL DEFAULT '{}';
