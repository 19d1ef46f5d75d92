-- The roles of the stores of Services B and C, with least privilege, as `aml-app postgres` provisions
-- its own (aml_app/harness/embedded_postgres.py; a unit test keeps the two equal): the pipeline writes as
-- aml_pipeline, which creates and owns the schemas; the APIs read as aml_api, which can change nothing.
-- Run once by the postgres image on a new data volume (/docker-entrypoint-initdb.d). Passwords: secrets
-- in production.
CREATE ROLE aml_pipeline LOGIN PASSWORD 'aml-pipeline-development-only';
CREATE ROLE aml_api LOGIN PASSWORD 'aml-api-development-only';
REVOKE ALL ON DATABASE aml FROM PUBLIC;
GRANT CONNECT, CREATE, TEMPORARY ON DATABASE aml TO aml_pipeline;
GRANT CONNECT ON DATABASE aml TO aml_api;
ALTER DEFAULT PRIVILEGES FOR ROLE aml_pipeline GRANT USAGE ON SCHEMAS TO aml_api;
ALTER DEFAULT PRIVILEGES FOR ROLE aml_pipeline GRANT SELECT ON TABLES TO aml_api;
DO $$
DECLARE
    owned record;
BEGIN
    FOR owned IN
        SELECT n.nspname FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner
        WHERE r.rolname IN ('aml', 'aml_pipeline') AND n.nspname IN ('relations', 'aggregates')
    LOOP
        EXECUTE format('ALTER SCHEMA %I OWNER TO aml_pipeline', owned.nspname);
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO aml_api', owned.nspname);
        EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA %I TO aml_api', owned.nspname);
    END LOOP;
    FOR owned IN
        SELECT c.oid::regclass AS name FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('relations', 'aggregates') AND c.relkind IN ('r', 'p')
            AND pg_get_userbyid(c.relowner) <> 'aml_pipeline'
    LOOP
        BEGIN
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE NOWAIT', owned.name);
            EXECUTE format('ALTER TABLE %s OWNER TO aml_pipeline', owned.name);
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE '% is in use: its owner changes at the next provisioning', owned.name;
        END;
    END LOOP;
END
$$;
