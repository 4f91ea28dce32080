"""The standard AWS configuration chain for an S3 output, through botocore: profiles
(``AWS_PROFILE``, ``--storage-option profile=NAME``), ``~/.aws/config`` and
``~/.aws/credentials`` (or ``AWS_CONFIG_FILE`` / ``AWS_SHARED_CREDENTIALS_FILE``), a profile's
``region`` and ``endpoint_url`` (also in a ``services`` section), and every credential source
botocore knows (SSO, assume-role, web identity, container and instance roles), refreshed as they
expire. docs/engine.md "Credentials, region and endpoint" has the precedence.

botocore is read only when it can add something: a profile is named, or a shared config or
credentials file exists. Otherwise obstore's own reading of the AWS environment is the whole
chain, and botocore is not imported.

Secrets never travel: a Dask worker gets the storage options (a profile's *name* at most) and
resolves the chain itself, in its own environment, so refreshable credentials refresh where they
are used. Nothing here logs a secret: only where credentials came from (botocore's ``method``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping

from ...errors import CredentialsError

log = logging.getLogger(__name__)

#: How long obstore may keep credentials that botocore refreshes (SSO, assume-role, web
#: identity, instance roles) before asking again. obstore asks again once fewer than 5 minutes
#: remain (object_store's token cache), so it uses one answer for at most 5 minutes; botocore
#: hands out credentials with at least 10 minutes left (its mandatory refresh), so a request is
#: never signed with expired ones. Static credentials never expire (None).
REFRESHABLE_TTL = timedelta(minutes=10)

_PROFILE_VARIABLES = ("AWS_DEFAULT_PROFILE", "AWS_PROFILE")  # botocore's order
_FILE_VARIABLES = (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))


@dataclass(frozen=True)
class AwsChain:
    """What the shared AWS configuration adds to an S3 store's explicit options."""

    region: str | None
    endpoint: str | None
    #: obstore's credential_provider (a callable), or None: the explicit options or obstore's
    #: own environment reading give the credentials.
    credentials: Callable[[], dict[str, Any]] | None
    #: Where the credentials came from, for the log (botocore's method, the profile): no secret.
    origin: str


def shared_files(env: Mapping[str, str] = os.environ) -> list[str]:
    """The AWS config and credentials files botocore reads, in that order (present or not)."""
    return [os.path.expanduser(env.get(var) or default) for var, default in _FILE_VARIABLES]


def profile_origin(profile: str | None, env: Mapping[str, str] = os.environ) -> tuple[str | None, str]:
    """(the profile in force, what named it): the storage option first, then botocore's variables."""
    if profile:
        return profile, "storage option profile"
    for var in _PROFILE_VARIABLES:
        if env.get(var):
            return env[var], var
    return None, "no AWS_PROFILE set"


def needs_botocore(profile: str | None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the shared configuration can add anything: a profile is named or a file exists."""
    return profile_origin(profile, env)[0] is not None or any(os.path.exists(f) for f in shared_files(env))


def resolve_chain(root: str, explicit: Mapping[str, Any], profile: str | None) -> AwsChain | None:
    """The region, endpoint and credentials the AWS chain gives ``root`` beyond ``explicit`` (the
    store's S3 options, aliases resolved); None when botocore has nothing to add. Raises
    CredentialsError naming the profile and the files searched."""
    if not needs_botocore(profile):
        return None
    import botocore.exceptions
    import botocore.session

    name, named_by = profile_origin(profile)
    session = botocore.session.Session(profile=profile or None)
    try:
        scoped = session.get_scoped_config()  # raises ProfileNotFound for a named profile that is absent
        region = os.environ.get("AWS_REGION") or session.get_config_variable("region")
        endpoint = _endpoint(session, scoped)
        need_credentials = not explicit.get("access_key_id") and str(
            explicit.get("skip_signature", "")
        ).lower() not in ("1", "true", "yes")
        credentials = session.get_credentials() if need_credentials else None
    except botocore.exceptions.ProfileNotFound:
        raise CredentialsError(
            f"{root}: AWS profile {name!r} ({named_by}) is not defined in {_files_and_profiles(session)}. To fix: "
            f"name a profile defined there, add [profile {name}] to the config file, or point AWS_CONFIG_FILE / "
            f"AWS_SHARED_CREDENTIALS_FILE at the files that define it."
        ) from None
    except (
        botocore.exceptions.BotoCoreError
    ) as exc:  # a broken profile: a missing services section, a bad SSO token, ...
        raise CredentialsError(
            f"{root}: the AWS configuration of profile {name or 'default'!r} ({named_by}) is unusable: {exc}. "
            f"Files read: {_files_and_profiles(session)}. To fix: correct that profile or name another."
        ) from None
    if need_credentials and credentials is None:
        raise CredentialsError(
            f"{root}: no AWS credentials: none in the storage options, none in the environment (AWS_ACCESS_KEY_ID, "
            f"AWS_SECRET_ACCESS_KEY), none for profile {name or 'default'!r} ({named_by}) in {_files_and_profiles(session)}, and no "
            f"SSO, web identity, container or instance role. To fix: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (on "
            f"Kubernetes: the Secret the job names), or name a profile that has credentials (AWS_PROFILE or --storage-option profile=NAME)."
        )
    origin = (
        f"{credentials.method} (profile {name or 'default'!r}, {named_by})"
        if credentials is not None
        else "the explicit storage options"
    )
    log.info("%s: AWS configuration from botocore; credentials from %s", root, origin)
    return AwsChain(
        region=region or None,
        endpoint=endpoint or None,
        credentials=BotocoreCredentials(credentials) if credentials is not None else None,
        origin=origin,
    )


def _endpoint(session: Any, scoped: dict[str, Any]) -> str | None:
    """The S3 endpoint URL configured for the profile, in the AWS SDKs' order: AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL, the profile's ``services`` section, the profile's ``endpoint_url``."""
    if session.get_config_variable("ignore_configured_endpoint_urls"):
        return None
    # botocore's own provider of that order (what its create_client uses; botocore is pinned, and
    # tests/test_s3_profiles.py reads an endpoint from a services section through it).
    from botocore.configprovider import ConfiguredEndpointProvider

    endpoint: str | None = ConfiguredEndpointProvider(
        full_config=session.full_config, scoped_config=scoped, client_name="s3"
    ).provide()
    return endpoint


def _files_and_profiles(session: Any) -> str:
    import botocore.exceptions

    files = " and ".join(f"{path}{'' if os.path.exists(path) else ' (missing)'}" for path in shared_files())
    try:
        names = sorted(session.available_profiles)
    except botocore.exceptions.BotoCoreError:  # a file that does not parse: the message still names the files
        names = []
    return f"{files} (profiles there: {', '.join(names) if names else 'none'})"


class BotocoreCredentials:
    """obstore's credential provider over botocore's credentials: static ones once, refreshable
    ones (SSO, assume-role, web identity, instance roles) re-read every REFRESHABLE_TTL."""

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def __call__(self) -> dict[str, Any]:
        from botocore.credentials import RefreshableCredentials

        frozen = self._credentials.get_frozen_credentials()  # botocore refreshes here when due
        expires = (
            datetime.now(timezone.utc) + REFRESHABLE_TTL
            if isinstance(self._credentials, RefreshableCredentials)
            else None
        )
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }

    def __repr__(self) -> str:  # never the keys
        return f"BotocoreCredentials({getattr(self._credentials, 'method', '?')})"
