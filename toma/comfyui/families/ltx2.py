"""LTX-2 (``LTXAVModel``, audio and video): refused. Its block replacement passes the video
and audio streams together, and the video's tokens are also the keys of the audio's
cross-attention, through per-token tables toma does not gather yet."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily

FAMILY = ComfyFamily(
    "ltx2",
    (hooks.LTXAV,),
    reason="LTX-2 has ComfyUI's block replacement (patches_replace['dit']), but its blocks pass the video and "
    "audio streams together, and the audio's cross-attention to the video's tokens takes per-token tables "
    "(v_cross_pe) that toma's ComfyUI node does not gather yet",
)
