"""Deep readiness: a model takes traffic only once it has answered one real request of its task. Each task
declares that request beside its route (its package's serving.py); the app hands them all to the state."""

from .classify.serving import CANARIES as CLASSIFY
from .detect.serving import CANARIES as DETECT
from .embeddings.serving import CANARIES as EMBEDDINGS
from .generate.serving import CANARIES as GENERATE
from .image_generation.serving import CANARIES as IMAGES
from .ner.serving import CANARIES as NER
from .rank.serving import CANARIES as RANK
from .speech.serving import CANARIES as SPEECH

CANARIES = {**CLASSIFY, **EMBEDDINGS, **NER, **GENERATE, **IMAGES, **DETECT, **SPEECH, **RANK}
