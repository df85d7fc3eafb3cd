"""The claims the provider sends: the user name, the e-mail address and the groups, as a company's provider does."""

from oauth2_provider.oauth2_validators import OAuth2Validator


class GroupsValidator(OAuth2Validator):
    oidc_claim_scope = {**OAuth2Validator.oidc_claim_scope, "groups": "groups"}

    def get_additional_claims(self, request):
        user = request.user
        return {
            "preferred_username": user.username,
            "email": user.email,
            "given_name": user.first_name,
            "groups": sorted(user.groups.values_list("name", flat=True)),
        }
