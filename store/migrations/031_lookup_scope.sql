-- A lookup's "not found" is taken as proof that no attempt took effect: it lets a key
-- that saves only successes be replayed, and past absence_final_after it makes the
-- operation FAILED_TERMINAL. The key's scope (010) covers the endpoint, the headers, the
-- key and the credential, but not where the lookup asks: a contract whose lookup was
-- repointed (another URL, method or "not found" status) after an operation was sent
-- would ask somewhere the effect need not be, and a second effect or a false failure
-- could follow. Each operation now keeps the fingerprint of the lookup it was first sent
-- under (NULL for one sent before this migration, or under a contract without a
-- lookup), set once like the key's scope and never changed after.
ALTER TABLE operations ADD COLUMN lookup_scope text;

CREATE FUNCTION operations_guard_lookup_scope() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'operation %: immutable column changed', OLD.operation_id
    USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

DO $$
BEGIN
  EXECUTE format('ALTER FUNCTION operations_guard_lookup_scope() SET search_path = %I, pg_temp', current_schema());
END;
$$;

CREATE TRIGGER operations_guard_lookup_scope BEFORE UPDATE ON operations FOR EACH ROW
  WHEN (NEW.lookup_scope IS DISTINCT FROM OLD.lookup_scope AND OLD.lookup_scope IS NOT NULL)
  EXECUTE FUNCTION operations_guard_lookup_scope();
