"""Images for vision-language models: loading and validating a row's images, the model's processor, and the image
tensors of a batch that follow its rows through every layout and forward."""

from lightalign.hub import is_vision_language_config, is_vision_language_model
from lightalign.vision.images import (IMAGE_COLUMNS, image_base_dir, load_image, row_image_values, row_images,
                                      stored_images)
from lightalign.vision.inputs import ImageInputs, model_inputs
from lightalign.vision.messages import count_image_parts, with_image_parts
from lightalign.vision.processor import ImageKeyLayout, encode_row, load_processor, measure_key_layout

__all__ = ["IMAGE_COLUMNS", "ImageInputs", "ImageKeyLayout", "count_image_parts", "encode_row", "image_base_dir",
           "is_vision_language_config", "is_vision_language_model", "load_image", "load_processor",
           "measure_key_layout", "model_inputs", "row_image_values", "row_images", "stored_images", "with_image_parts"]
