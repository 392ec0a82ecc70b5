"""Wire types the request models share, with their limits declared in the OpenAPI schema.

JSON numbers beyond 2**53 are not exact in most JSON parsers (the gateway's parses them as floats), so
integers are declared within the safe range rather than accepted here and refused later.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictStr, StringConstraints

Text = Annotated[StrictStr, StringConstraints(pattern=r"\S")]  # not empty, not only blanks
Texts = Annotated[list[Text], Field(min_length=1)]
SafeInt = Annotated[int, Field(ge=-(2**53), le=2**53)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
