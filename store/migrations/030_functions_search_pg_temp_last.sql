-- The ledger's trigger functions read its tables by name: most pinned to the ledger's
-- schema (SET search_path FROM CURRENT), four in the caller's search_path. PostgreSQL
-- looks for a table in the session's temporary schema before any schema of the path
-- unless the path names pg_temp, so any role that may create temporary tables (PUBLIC
-- may, by default), the broker's too, could shadow one: a temporary operations made the
-- keys' guard (026) and the TRUNCATE check (029) find no operation, and a temporary
-- operation_transitions let the guard pass a move it exists to refuse (a CANCELLED
-- operation back to PREPARED, to be sent). Every function of the ledger now searches
-- its own schema, then pg_temp, last: the plain functions of the ledger's schema that
-- no extension installed there.
DO $$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
      WHERE n.nspname = current_schema() AND p.prokind = 'f'
        AND NOT EXISTS (SELECT 1 FROM pg_depend d
          WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e') LOOP
    EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
  END LOOP;
END;
$$;
