-- Every mutating request the gateway answered: who (the key's owner, never the key), what,
-- when and with what outcome. Kept for the operators' audit; nothing reads it back to decide.
CREATE TABLE gateway_audit (
    id          bigserial   PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    principal   text        NOT NULL,
    role        text,
    method      text        NOT NULL,
    path        text        NOT NULL,
    status      integer     NOT NULL,
    outcome     text        NOT NULL,
    remote      text,
    run_id      uuid
);
CREATE INDEX gateway_audit_at ON gateway_audit (at DESC);
CREATE INDEX gateway_audit_principal ON gateway_audit (principal, at DESC);
